package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hamba/avro/v2"
	"github.com/hamba/avro/v2/soe"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

var readTypes = []string{"SpanRecorded", "AttemptFinished", "RolloutFinished"}

// SpanReader reads the spans of given rollouts: the partitions their ids hash to (murmur2,
// as every agl-stream producer partitions) of the spans and rollouts topics, from the
// beginning, until each rollout has finished (RolloutFinished) and every attempt of it that
// finished has all the spans its AttemptFinished counts. It writes each span once (a
// runner's attempt is delivered at least once) as one JSON line: the SpanRecorded record as
// Avro reads it, unions unwrapped, uuid as text, timestamp-micros as an integer.
type SpanReader struct {
	settings   Settings
	schemas    *Schemas
	readers    map[[8]byte]avro.Schema // writer fingerprint -> the schema to decode it with
	wanted     []string
	finished   map[string]bool
	spanCounts map[string]int64          // attempt id -> spans it emitted
	sequences  map[string]map[int64]bool // attempt id -> spans read
	attemptOf  map[string]string         // attempt id -> its rollout
	out        *bufio.Writer
}

func NewSpanReader(settings Settings, schemas *Schemas, rolloutIDs []string, out *bufio.Writer) (*SpanReader, error) {
	r := &SpanReader{
		settings: settings, schemas: schemas, readers: map[[8]byte]avro.Schema{},
		wanted: rolloutIDs, finished: map[string]bool{}, spanCounts: map[string]int64{},
		sequences: map[string]map[int64]bool{}, attemptOf: map[string]string{}, out: out,
	}
	compatibility := avro.NewSchemaCompatibility()
	for _, eventType := range readTypes {
		current, err := schemas.Of(eventType)
		if err != nil {
			return nil, err
		}
		r.readers[current.Fingerprint] = current.Schema
		for _, older := range schemas.Released {
			if older.EventType != eventType || older.Fingerprint == current.Fingerprint {
				continue
			}
			// Bytes of an earlier release, read as the current schema has them.
			resolved, err := compatibility.Resolve(current.Schema, older.Schema)
			if err != nil {
				return nil, fmt.Errorf("%s of release %s: %w", eventType, older.Release, err)
			}
			r.readers[older.Fingerprint] = resolved
		}
	}
	return r, nil
}

// Read reports whether every rollout was read whole within the time given.
func (r *SpanReader) Read(within time.Duration) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	admin, err := kgo.NewClient(kgo.SeedBrokers(r.settings.Brokers()...), kgo.ClientID(clientID))
	if err != nil {
		return false, err
	}
	partitions := map[string]map[int32]kgo.Offset{}
	for _, short := range []string{"rollouts", "spans"} {
		topic := r.settings.Topic(short)
		count, err := partitionCount(ctx, admin, topic)
		if err != nil {
			admin.Close()
			return false, err
		}
		partitions[topic] = map[int32]kgo.Offset{}
		hasher := kgo.StickyKeyPartitioner(nil).ForTopic(topic)
		for _, id := range r.wanted {
			p := hasher.Partition(&kgo.Record{Key: []byte(id)}, count)
			partitions[topic][int32(p)] = kgo.NewOffset().AtStart()
		}
	}
	admin.Close()
	client, err := kgo.NewClient(
		kgo.SeedBrokers(r.settings.Brokers()...), kgo.ClientID(clientID),
		kgo.ConsumePartitions(partitions),
		// Runners write through transactions: what an aborted one left must never be read.
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
	)
	if err != nil {
		return false, err
	}
	defer client.Close()
	for !r.done() && ctx.Err() == nil {
		fetches := client.PollFetches(ctx)
		for _, e := range fetches.Errors() {
			if ctx.Err() == nil {
				return false, fmt.Errorf("reading %s[%d]: %w", e.Topic, e.Partition, e.Err)
			}
		}
		var failed error
		fetches.EachRecord(func(record *kgo.Record) {
			if failed == nil {
				failed = r.take(record.Value)
			}
		})
		if failed != nil {
			return false, failed
		}
		if err := r.out.Flush(); err != nil {
			return false, err
		}
	}
	return r.done(), r.out.Flush()
}

// Missing says what is still missing, for a message.
func (r *SpanReader) Missing() string {
	var parts []string
	for _, id := range r.wanted {
		if !r.finished[id] {
			parts = append(parts, id+" has not finished")
		}
	}
	for attempt, count := range r.spanCounts {
		if have := int64(len(r.sequences[attempt])); have < count {
			parts = append(parts, fmt.Sprintf("attempt %s of %s has %d of %d spans", attempt, r.attemptOf[attempt], have, count))
		}
	}
	return strings.Join(parts, "; ")
}

func (r *SpanReader) done() bool {
	for _, id := range r.wanted {
		if !r.finished[id] {
			return false
		}
	}
	for attempt, count := range r.spanCounts {
		if int64(len(r.sequences[attempt])) < count {
			return false
		}
	}
	return true
}

func (r *SpanReader) take(value []byte) error {
	fingerprint, body, err := soe.ParseHeader(value)
	if err != nil {
		return nil // not single-object encoded: agl-stream's own consumers dead-letter it
	}
	writer, known := r.schemas.ByFingerprint(fingerprint)
	if !known || !slices.Contains(readTypes, writer.EventType) {
		return nil
	}
	reader := r.readers[writer.Fingerprint]
	var decoded any
	if err := avro.Unmarshal(reader, body, &decoded); err != nil {
		return fmt.Errorf("undecodable %s: %w", writer.EventType, err)
	}
	event, _ := decoded.(map[string]any)
	rollout, _ := event["rollout_id"].(string)
	if !slices.Contains(r.wanted, rollout) {
		return nil
	}
	switch writer.EventType {
	case "SpanRecorded":
		attempt, _ := event["attempt_id"].(string)
		sequence, _ := event["sequence"].(int64)
		r.attemptOf[attempt] = rollout
		if r.sequences[attempt] == nil {
			r.sequences[attempt] = map[int64]bool{}
		}
		if !r.sequences[attempt][sequence] {
			r.sequences[attempt][sequence] = true
			if err := writeJSON(r.out, reader, decoded); err != nil {
				return err
			}
			return r.out.WriteByte('\n')
		}
	case "AttemptFinished":
		attempt, _ := event["attempt_id"].(string)
		r.attemptOf[attempt] = rollout
		if _, seen := r.spanCounts[attempt]; !seen {
			r.spanCounts[attempt], _ = event["span_count"].(int64)
		}
	default: // RolloutFinished
		r.finished[rollout] = true
	}
	return nil
}

func partitionCount(ctx context.Context, client *kgo.Client, topic string) (int, error) {
	req := kmsg.NewPtrMetadataRequest()
	req.Topics = []kmsg.MetadataRequestTopic{{Topic: kmsg.StringPtr(topic)}}
	resp, err := req.RequestWith(ctx, client)
	if err != nil {
		return 0, err
	}
	if len(resp.Topics) != 1 {
		return 0, fmt.Errorf("no metadata for topic %s", topic)
	}
	if err := kerr.ErrorForCode(resp.Topics[0].ErrorCode); err != nil {
		return 0, fmt.Errorf("topic %s (is the topic prefix right?): %w", topic, err)
	}
	return len(resp.Topics[0].Partitions), nil
}

// writeJSON writes a value decoded with schema as plain JSON: records as objects in field
// order, unions as their branch's value, enums as their symbol, timestamps as integers.
func writeJSON(w *bufio.Writer, schema avro.Schema, value any) error {
	if ref, ok := schema.(*avro.RefSchema); ok {
		schema = ref.Schema()
	}
	if value == nil {
		_, err := w.WriteString("null")
		return err
	}
	switch s := schema.(type) {
	case *avro.UnionSchema:
		// The generic decoder gives a union's value as {branch name: value}, but a
		// ["null", T] union's as T's value itself.
		if wrapped, ok := value.(map[string]any); ok && len(wrapped) == 1 {
			for key, inner := range wrapped {
				for _, branch := range s.Types() {
					if unionBranchName(branch) == key {
						return writeJSON(w, branch, inner)
					}
				}
			}
		}
		if s.Nullable() {
			for _, branch := range s.Types() {
				if branch.Type() != avro.Null {
					return writeJSON(w, branch, value)
				}
			}
		}
		return fmt.Errorf("a %T value in a union %s", value, s)
	case *avro.RecordSchema:
		fields, ok := value.(map[string]any)
		if !ok {
			return fmt.Errorf("a %T value for record %s", value, s.FullName())
		}
		w.WriteByte('{')
		for i, field := range s.Fields() {
			if i > 0 {
				w.WriteByte(',')
			}
			writeString(w, field.Name())
			w.WriteByte(':')
			if err := writeJSON(w, field.Type(), fields[field.Name()]); err != nil {
				return err
			}
		}
		return w.WriteByte('}')
	case *avro.MapSchema:
		entries, ok := value.(map[string]any)
		if !ok {
			return fmt.Errorf("a %T value for a map", value)
		}
		keys := make([]string, 0, len(entries))
		for key := range entries {
			keys = append(keys, key)
		}
		slices.Sort(keys)
		w.WriteByte('{')
		for i, key := range keys {
			if i > 0 {
				w.WriteByte(',')
			}
			writeString(w, key)
			w.WriteByte(':')
			if err := writeJSON(w, s.Values(), entries[key]); err != nil {
				return err
			}
		}
		return w.WriteByte('}')
	case *avro.ArraySchema:
		items, ok := value.([]any)
		if !ok {
			return fmt.Errorf("a %T value for an array", value)
		}
		w.WriteByte('[')
		for i, item := range items {
			if i > 0 {
				w.WriteByte(',')
			}
			if err := writeJSON(w, s.Items(), item); err != nil {
				return err
			}
		}
		return w.WriteByte(']')
	}
	switch v := value.(type) {
	case string:
		writeString(w, v)
	case bool:
		w.WriteString(strconv.FormatBool(v))
	case int:
		w.WriteString(strconv.Itoa(v))
	case int64:
		w.WriteString(strconv.FormatInt(v, 10))
	case time.Time: // timestamp-micros, as the integer it is on the wire
		w.WriteString(strconv.FormatInt(v.UnixMicro(), 10))
	case float64:
		writeFloat(w, v)
	case float32:
		writeFloat(w, float64(v))
	default:
		return fmt.Errorf("no JSON form for %T", value)
	}
	return nil
}

func writeString(w *bufio.Writer, s string) {
	encoded, _ := json.Marshal(s) // a string always encodes
	w.Write(encoded)
}

func writeFloat(w *bufio.Writer, v float64) {
	switch {
	case math.IsNaN(v):
		w.WriteString("NaN")
	case math.IsInf(v, 1):
		w.WriteString("Infinity")
	case math.IsInf(v, -1):
		w.WriteString("-Infinity")
	default:
		text := strconv.FormatFloat(v, 'g', -1, 64)
		if !strings.ContainsAny(text, ".eEn") {
			text += ".0" // still a float when read back
		}
		w.WriteString(text)
	}
}

// unionBranchName is how the generic decoder names a union's branch: a named type by its
// full name, any other by its type (and logical type).
func unionBranchName(schema avro.Schema) string {
	if ref, ok := schema.(*avro.RefSchema); ok {
		schema = ref.Schema()
	}
	if named, ok := schema.(avro.NamedSchema); ok {
		return named.FullName()
	}
	name := string(schema.Type())
	if logical, ok := schema.(avro.LogicalTypeSchema); ok && logical.Logical() != nil {
		name += "." + string(logical.Logical().Type())
	}
	return name
}
