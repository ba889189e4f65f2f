package main

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/hamba/avro/v2"
)

const namespace = "ai.aglstream"

// Version is one event schema: a current one (schemas/EVENT.avsc) or a released one
// (schemas/released/VERSION/EVENT.avsc, fully expanded).
type Version struct {
	EventType   string
	Release     string
	Schema      avro.Schema
	Fingerprint [8]byte // CRC-64-AVRO of the Parsing Canonical Form, little-endian: as on the wire
}

// Schemas are agl-stream's event schemas, read from its schemas/ folder, by fingerprint.
type Schemas struct {
	Current       map[string]Version
	Released      []Version
	byFingerprint map[[8]byte]Version
}

// LoadSchemas reads every current and released event schema under dir.
func LoadSchemas(dir string) (*Schemas, error) {
	if info, err := os.Stat(dir); err != nil || !info.IsDir() {
		return nil, fmt.Errorf("no schemas folder at %s (give agl-stream's schemas/ with -schemas)", dir)
	}
	s := &Schemas{Current: map[string]Version{}, byFingerprint: map[[8]byte]Version{}}
	// One cache for the folder: events name the shared types (ai.aglstream.*.avsc), which
	// may name each other.
	cache := &avro.SchemaCache{}
	shared, err := avscFiles(dir, true)
	if err != nil {
		return nil, err
	}
	if err := parseInAnyOrder(shared, cache); err != nil {
		return nil, err
	}
	events, err := avscFiles(dir, false)
	if err != nil {
		return nil, err
	}
	for _, path := range events {
		schema, err := parseFile(path, cache)
		if err != nil {
			return nil, err
		}
		if err := s.add(stem(path), "current", schema, true); err != nil {
			return nil, err
		}
	}
	releases, _ := filepath.Glob(filepath.Join(dir, "released", "*"))
	sort.Strings(releases)
	for _, release := range releases {
		files, err := avscFiles(release, false)
		if err != nil {
			return nil, err
		}
		for _, path := range files {
			// Fully expanded: each names its own types, so a cache of its own.
			schema, err := parseFile(path, &avro.SchemaCache{})
			if err != nil {
				return nil, err
			}
			if err := s.add(stem(path), filepath.Base(release), schema, false); err != nil {
				return nil, err
			}
		}
	}
	return s, nil
}

// Of is the current schema of an event type.
func (s *Schemas) Of(eventType string) (Version, error) {
	v, ok := s.Current[eventType]
	if !ok {
		return Version{}, fmt.Errorf("no schema for %s under the schemas folder", eventType)
	}
	return v, nil
}

// ByFingerprint is the schema a record's header names, if agl-stream ever released it.
func (s *Schemas) ByFingerprint(fingerprint []byte) (Version, bool) {
	var key [8]byte
	if len(fingerprint) != len(key) {
		return Version{}, false
	}
	copy(key[:], fingerprint)
	v, ok := s.byFingerprint[key]
	return v, ok
}

func (v Version) FingerprintHex() string { return hex.EncodeToString(v.Fingerprint[:]) }

func (s *Schemas) add(eventType, release string, schema avro.Schema, current bool) error {
	fingerprint, err := Fingerprint(schema)
	if err != nil {
		return err
	}
	v := Version{EventType: eventType, Release: release, Schema: schema}
	copy(v.Fingerprint[:], fingerprint)
	if current {
		s.Current[eventType] = v
	} else {
		s.Released = append(s.Released, v)
	}
	if _, seen := s.byFingerprint[v.Fingerprint]; !seen {
		s.byFingerprint[v.Fingerprint] = v
	}
	return nil
}

// Fingerprint is the schema's CRC-64-AVRO fingerprint as single-object encoding writes it
// (little-endian), of its Parsing Canonical Form as the Avro specification defines it: with
// no logicalType attribute. hamba/avro's own fingerprints (and so its soe package) keep
// logicalType in the text they hash, which gives other fingerprints than Apache Avro's Java
// library and fastavro for every schema with a logical type (all of agl-stream's): so the
// text is hashed again from a copy of the schema without them.
func Fingerprint(schema avro.Schema) ([]byte, error) {
	var tree any
	if err := json.Unmarshal([]byte(schema.String()), &tree); err != nil {
		return nil, err
	}
	plainText, err := json.Marshal(withoutLogicalTypes(tree))
	if err != nil {
		return nil, err
	}
	plain, err := avro.ParseBytesWithCache(plainText, "", &avro.SchemaCache{})
	if err != nil {
		return nil, err
	}
	return plain.FingerprintUsing(avro.CRC64AvroLE)
}

func withoutLogicalTypes(tree any) any {
	switch node := tree.(type) {
	case map[string]any:
		out := make(map[string]any, len(node))
		for key, value := range node {
			if key != "logicalType" {
				out[key] = withoutLogicalTypes(value)
			}
		}
		return out
	case []any:
		out := make([]any, len(node))
		for i, value := range node {
			out[i] = withoutLogicalTypes(value)
		}
		return out
	}
	return tree
}

// parseInAnyOrder parses files that may name each other: a file whose names are not known
// yet fails (leaving the cache as it was) and is tried again after the others.
func parseInAnyOrder(paths []string, cache *avro.SchemaCache) error {
	left := paths
	for len(left) > 0 {
		var failed []string
		var last error
		for _, path := range left {
			if _, err := parseFile(path, cache); err != nil {
				failed = append(failed, path)
				last = err
			}
		}
		if len(failed) == len(left) {
			return errors.Join(fmt.Errorf("cannot parse %v", failed), last)
		}
		left = failed
	}
	return nil
}

func parseFile(path string, cache *avro.SchemaCache) (avro.Schema, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	schema, err := avro.ParseBytesWithCache(data, "", cache)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return schema, nil
}

func avscFiles(dir string, shared bool) ([]string, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "*.avsc"))
	if err != nil {
		return nil, err
	}
	var out []string
	for _, path := range paths {
		if strings.HasPrefix(stem(path), namespace+".") == shared {
			out = append(out, path)
		}
	}
	sort.Strings(out)
	return out, nil
}

func stem(path string) string { return strings.TrimSuffix(filepath.Base(path), ".avsc") }
