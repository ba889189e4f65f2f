package main

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/hamba/avro/v2"
	"github.com/hamba/avro/v2/soe"
)

const (
	maxIDLength     = 256
	maxInputBytes   = 900_000 // under the broker's 1 MB record limit
	eventTypeHeader = "agl.event_type"
)

// RolloutQueued is schemas/RolloutQueued.avsc: a rollout put on the tasks topic.
type RolloutQueued struct {
	EventID             string            `avro:"event_id"`
	OccurredAt          int64             `avro:"occurred_at"` // timestamp-micros
	RolloutID           string            `avro:"rollout_id"`
	AttemptNumber       int32             `avro:"attempt_number"`
	InputJSON           string            `avro:"input_json"`
	Mode                string            `avro:"mode"`
	ResourcesID         *string           `avro:"resources_id"`
	TimeoutSeconds      *float64          `avro:"timeout_seconds"`
	UnresponsiveSeconds *float64          `avro:"unresponsive_seconds"`
	MaxAttempts         int32             `avro:"max_attempts"`
	RetryCondition      []string          `avro:"retry_condition"`
	Metadata            map[string]string `avro:"metadata"`
	FirstQueuedAt       int64             `avro:"first_queued_at"` // timestamp-micros
	PreviousAttemptID   *string           `avro:"previous_attempt_id"`
}

// RewardRecorded is schemas/RewardRecorded.avsc: a reward given from outside an attempt.
type RewardRecorded struct {
	EventID    string            `avro:"event_id"`
	OccurredAt int64             `avro:"occurred_at"` // timestamp-micros
	RolloutID  string            `avro:"rollout_id"`
	AttemptID  *string           `avro:"attempt_id"`
	SpanID     *string           `avro:"span_id"`
	Name       string            `avro:"name"`
	Value      float64           `avro:"value"`
	Source     *string           `avro:"source"`
	Metadata   map[string]string `avro:"metadata"`
}

// Events builds the events this client writes, checked as agl-stream's consumers check
// them (an event they would refuse goes to the dead-letter topic there), and encodes them
// in Avro single-object encoding: C3 01, the schema's fingerprint, the Avro body.
type Events struct {
	queued, reward encoder
	modes          []string
}

// encoder writes one schema's records in single-object encoding.
type encoder struct {
	schema avro.Schema
	header []byte
}

func newEncoder(v Version) (encoder, error) {
	header, err := soe.BuildHeaderForFingerprint(v.Fingerprint[:])
	return encoder{v.Schema, header}, err
}

func (e encoder) Encode(value any) ([]byte, error) {
	body, err := avro.Marshal(e.schema, value)
	if err != nil {
		return nil, err
	}
	return append(slices.Clip(e.header), body...), nil
}

func NewEvents(schemas *Schemas) (*Events, error) {
	queued, err := schemas.Of("RolloutQueued")
	if err != nil {
		return nil, err
	}
	reward, err := schemas.Of("RewardRecorded")
	if err != nil {
		return nil, err
	}
	e := &Events{}
	if e.queued, err = newEncoder(queued); err != nil {
		return nil, err
	}
	if e.reward, err = newEncoder(reward); err != nil {
		return nil, err
	}
	for _, field := range queued.Schema.(*avro.RecordSchema).Fields() {
		if field.Name() == "mode" {
			e.modes = enumSymbols(field.Type())
		}
	}
	return e, nil
}

// RolloutQueued is a rollout's first attempt, queued now: what `agl-stream enqueue` writes.
func (e *Events) RolloutQueued(rolloutID, inputJSON, mode string, maxAttempts int) ([]byte, error) {
	if err := checkID("rollout_id", rolloutID); err != nil {
		return nil, err
	}
	if err := checkJSON(inputJSON); err != nil {
		return nil, err
	}
	if !slices.Contains(e.modes, mode) {
		return nil, fmt.Errorf("mode must be one of %v, got %q", e.modes, mode)
	}
	if maxAttempts < 1 || maxAttempts > math.MaxInt32 {
		return nil, fmt.Errorf("max attempts must be 1 or more, got %d", maxAttempts)
	}
	now := time.Now().UnixMicro()
	return e.queued.Encode(RolloutQueued{
		EventID: newUUID(), OccurredAt: now, RolloutID: rolloutID, AttemptNumber: 1,
		InputJSON: inputJSON, Mode: mode, MaxAttempts: int32(maxAttempts),
		RetryCondition: []string{}, Metadata: map[string]string{},
		FirstQueuedAt: now, // attempt 1: when it was first queued is now
	})
}

// RewardRecorded is a reward for a rollout (or one attempt of it, when attemptID is given).
func (e *Events) RewardRecorded(rolloutID string, value float64, name, attemptID, source string) ([]byte, string, error) {
	if err := checkID("rollout_id", rolloutID); err != nil {
		return nil, "", err
	}
	if math.IsNaN(value) || math.IsInf(value, 0) {
		return nil, "", fmt.Errorf("a reward must be a finite number, got %v", value)
	}
	if n := utf8.RuneCountInString(name); n < 1 || n > 200 {
		return nil, "", fmt.Errorf("a reward's name must have 1 to 200 characters")
	}
	event := RewardRecorded{
		EventID: newUUID(), OccurredAt: time.Now().UnixMicro(), RolloutID: rolloutID,
		Name: name, Value: value, Metadata: map[string]string{},
	}
	if attemptID != "" {
		if err := checkID("attempt_id", attemptID); err != nil {
			return nil, "", err
		}
		event.AttemptID = &attemptID
	}
	if source != "" {
		event.Source = &source
	}
	data, err := e.reward.Encode(event)
	return data, event.EventID, err
}

// checkID is agl-stream's id rule (agl_stream/events/ids.py): 1 to 256 printable characters.
func checkID(field, value string) error {
	if value == "" {
		return fmt.Errorf("%s must not be empty", field)
	}
	if !utf8.ValidString(value) {
		return fmt.Errorf("%s must be UTF-8 text", field)
	}
	if n := utf8.RuneCountInString(value); n > maxIDLength {
		return fmt.Errorf("%s must be at most %d characters long (it has %d)", field, maxIDLength, n)
	}
	position := 0
	for _, r := range value {
		position++
		if !printable(r) {
			return fmt.Errorf("%s must hold printable characters only (character %d is U+%04X, which is not)", field, position, r)
		}
	}
	return nil
}

// printable is Python's str.isprintable: no control, format, surrogate, private or
// unassigned code point, and no separator but the ASCII space.
func printable(r rune) bool {
	if r == ' ' {
		return true
	}
	return unicode.In(r, unicode.L, unicode.M, unicode.N, unicode.P, unicode.S)
}

func checkJSON(text string) error {
	if len(text) > maxInputBytes {
		return fmt.Errorf("task input is %d bytes encoded, over the limit of %d; store large inputs elsewhere and pass a reference", len(text), maxInputBytes)
	}
	if !utf8.ValidString(text) {
		return fmt.Errorf("task input is not UTF-8 text")
	}
	if !json.Valid([]byte(text)) {
		return fmt.Errorf("task input is not JSON: %.80s", text)
	}
	return nil
}

func enumSymbols(schema avro.Schema) []string {
	if ref, ok := schema.(*avro.RefSchema); ok {
		schema = ref.Schema()
	}
	if enum, ok := schema.(*avro.EnumSchema); ok {
		return enum.Symbols()
	}
	return nil
}

// newUUID is a random (version 4) UUID in its text form.
func newUUID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}
