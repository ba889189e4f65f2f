// Command agl-stream-go-client queues tasks, gives rewards and reads spans of agl-stream
// from Go: franz-go for Kafka, hamba/avro for the event schemas under ../../schemas, read at
// run time. No agl-stream code is involved. See README.md.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

const clientID = "agl-stream-go-client"

const usage = `usage: agl-stream-go-client COMMAND [OPTIONS] [ARGS]

  enqueue [-file TASKS.jsonl] [-mode train|val|test] [-max-attempts N]
      one rollout per JSON line (standard input without -file); prints their ids
  reward [-name NAME] [-attempt-id ID] [-source SOURCE] ROLLOUT_ID VALUE [ROLLOUT_ID VALUE ...]
      gives each rollout a reward (RewardRecorded); prints the events' ids
  spans [-timeout SECONDS] ROLLOUT_ID [ROLLOUT_ID ...]
      prints the rollouts' spans as JSON lines once they have finished
  fingerprints
      prints each schema's release, event type and fingerprint as on the wire

options of every command: -bootstrap-servers HOST:PORT (AGL_STREAM_BOOTSTRAP_SERVERS,
  default 127.0.0.1:19092), -topic-prefix PREFIX (AGL_STREAM_TOPIC_PREFIX, default agl.),
  -schemas DIR (agl-stream's schemas/, default ../../schemas)
`

// Settings say where the cluster is and how its topics are named: flags first, then
// agl-stream's own environment variables, then its defaults, so this client finds what
// `agl-stream up` started.
type Settings struct {
	BootstrapServers string
	TopicPrefix      string
	SchemasDir       string
}

func (s Settings) Brokers() []string { return strings.Split(s.BootstrapServers, ",") }

// Topic is a topic's full name: the prefix, then its short name (tasks, rollouts, spans).
func (s Settings) Topic(short string) string { return s.TopicPrefix + short }

var prefixRule = regexp.MustCompile(`^[A-Za-z0-9._-]*$`)

func flags(command string, s *Settings) *flag.FlagSet {
	set := flag.NewFlagSet(command, flag.ContinueOnError)
	set.StringVar(&s.BootstrapServers, "bootstrap-servers", env("AGL_STREAM_BOOTSTRAP_SERVERS", "127.0.0.1:19092"), "host:port list of brokers")
	set.StringVar(&s.TopicPrefix, "topic-prefix", env("AGL_STREAM_TOPIC_PREFIX", "agl."), "prefix of the topic names")
	set.StringVar(&s.SchemasDir, "schemas", "../../schemas", "agl-stream's schemas/ folder")
	set.Usage = func() { fmt.Fprint(os.Stderr, usage) }
	return set
}

func env(name, fallback string) string {
	if value := os.Getenv(name); value != "" {
		return value
	}
	return fallback
}

// usageError is a mistake in the command line: exit status 2.
type usageError struct{ error }

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" {
		fmt.Print(usage)
		if len(os.Args) < 2 {
			os.Exit(2)
		}
		return
	}
	command := os.Args[1]
	code, err := run(command, os.Args[2:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "agl-stream-go-client %s: %v\n", command, err)
		var mistake usageError
		if errors.As(err, &mistake) {
			code = 2
		} else if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

func run(command string, args []string) (int, error) {
	var s Settings
	set := flags(command, &s)
	var file, mode, name, attemptID, source string
	var maxAttempts int
	var timeout float64
	switch command {
	case "enqueue":
		set.StringVar(&file, "file", "", "task inputs, one JSON value a line (default: standard input)")
		set.StringVar(&mode, "mode", "train", "train, val or test")
		set.IntVar(&maxAttempts, "max-attempts", 1, "attempts before the rollout fails")
	case "reward":
		set.StringVar(&name, "name", "reward", "which reward (several may be given to one rollout)")
		set.StringVar(&attemptID, "attempt-id", "", "the attempt it is for (default: the rollout as a whole)")
		set.StringVar(&source, "source", "go-client", "who gives it")
	case "spans":
		set.Float64Var(&timeout, "timeout", 60, "seconds to wait for the rollouts to finish")
	case "fingerprints":
	default:
		return 2, usageError{fmt.Errorf("unknown command\n%s", usage)}
	}
	if err := set.Parse(args); err != nil {
		return 2, usageError{err}
	}
	if !prefixRule.MatchString(s.TopicPrefix) {
		return 2, usageError{fmt.Errorf("-topic-prefix may hold only letters, digits, '.', '_' and '-', got %q", s.TopicPrefix)}
	}
	schemas, err := LoadSchemas(s.SchemasDir)
	if err != nil {
		return 2, usageError{err}
	}
	switch command {
	case "enqueue":
		return enqueue(s, schemas, file, mode, maxAttempts)
	case "reward":
		return reward(s, schemas, set.Args(), name, attemptID, source)
	case "spans":
		return spans(s, schemas, set.Args(), timeout)
	default:
		return fingerprints(schemas)
	}
}

func producer(s Settings) (*kgo.Client, error) {
	return kgo.NewClient(
		kgo.SeedBrokers(s.Brokers()...), kgo.ClientID(clientID),
		// As agl-stream's own producers: acks from every replica, idempotent (franz-go's
		// defaults), 5 ms linger, records as they are (the topics compress).
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(5*time.Millisecond),
		kgo.ProducerBatchCompression(kgo.NoCompression()),
		// Keyed by rollout id, murmur2 as Kafka's and aiokafka's default partitioners: the
		// partition agl-stream's own producers use for that rollout, on every
		// co-partitioned topic.
		kgo.RecordPartitioner(kgo.StickyKeyPartitioner(nil)),
	)
}

func record(topic, key string, value []byte, eventType string) *kgo.Record {
	return &kgo.Record{
		Topic: topic, Key: []byte(key), Value: value,
		Headers: []kgo.RecordHeader{{Key: eventTypeHeader, Value: []byte(eventType)}},
	}
}

func enqueue(s Settings, schemas *Schemas, file, mode string, maxAttempts int) (int, error) {
	events, err := NewEvents(schemas)
	if err != nil {
		return 1, err
	}
	var input io.Reader = os.Stdin
	where := "<stdin>"
	if file != "" {
		f, err := os.Open(file)
		if err != nil {
			return 2, usageError{err}
		}
		defer f.Close()
		input, where = f, file
	}
	lines := bufio.NewScanner(input)
	lines.Buffer(make([]byte, 64*1024), maxInputBytes+1)
	began := time.Now()
	// Every task is checked before any is sent: a bad line queues nothing.
	var ids []string
	var values [][]byte
	for number := 1; lines.Scan(); number++ {
		line := lines.Text()
		if strings.TrimSpace(line) == "" {
			continue
		}
		id := "ro-" + strings.ReplaceAll(newUUID(), "-", "")
		value, err := events.RolloutQueued(id, line, mode, maxAttempts)
		if err != nil {
			return 2, usageError{fmt.Errorf("%s:%d: %w", where, number, err)}
		}
		ids, values = append(ids, id), append(values, value)
	}
	if err := lines.Err(); err != nil {
		return 2, usageError{fmt.Errorf("%s: %w", where, err)}
	}
	client, err := producer(s)
	if err != nil {
		return 1, err
	}
	defer client.Close()
	ctx := context.Background()
	var failure error
	var mu sync.Mutex
	topic := s.Topic("tasks")
	for i, id := range ids {
		client.Produce(ctx, record(topic, id, values[i], "RolloutQueued"), func(_ *kgo.Record, err error) {
			if err != nil {
				mu.Lock()
				failure = errors.Join(failure, err)
				mu.Unlock()
			}
		})
	}
	if err := client.Flush(ctx); err != nil { // every send acknowledged or failed
		return 1, err
	}
	seconds := time.Since(began).Seconds()
	if failure != nil {
		return 1, fmt.Errorf("the broker did not take every task: %w", failure)
	}
	out := bufio.NewWriter(os.Stdout)
	for _, id := range ids {
		out.WriteString(id + "\n")
	}
	if err := out.Flush(); err != nil {
		return 1, err
	}
	fmt.Fprintf(os.Stderr, "queued %d rollouts in %.3f s (%.0f/s)\n", len(ids), seconds, float64(len(ids))/max(seconds, 1e-9))
	return 0, nil
}

func reward(s Settings, schemas *Schemas, pairs []string, name, attemptID, source string) (int, error) {
	if len(pairs) == 0 || len(pairs)%2 != 0 {
		return 2, usageError{errors.New("give ROLLOUT_ID VALUE pairs")}
	}
	events, err := NewEvents(schemas)
	if err != nil {
		return 1, err
	}
	var records []*kgo.Record
	var ids []string
	for i := 0; i < len(pairs); i += 2 {
		value, err := strconv.ParseFloat(pairs[i+1], 64)
		if err != nil {
			return 2, usageError{fmt.Errorf("a reward must be a number, got %q", pairs[i+1])}
		}
		data, id, err := events.RewardRecorded(pairs[i], value, name, attemptID, source)
		if err != nil {
			return 2, usageError{err}
		}
		// On the rollouts topic, keyed by rollout id: it counts when an attempt of its
		// rollout lies before it there (the same partition, by the same partitioner).
		records = append(records, record(s.Topic("rollouts"), pairs[i], data, "RewardRecorded"))
		ids = append(ids, id)
	}
	client, err := producer(s)
	if err != nil {
		return 1, err
	}
	defer client.Close()
	if err := client.ProduceSync(context.Background(), records...).FirstErr(); err != nil {
		return 1, fmt.Errorf("the broker did not take a reward: %w", err)
	}
	fmt.Println(strings.Join(ids, "\n"))
	return 0, nil
}

func spans(s Settings, schemas *Schemas, rolloutIDs []string, timeout float64) (int, error) {
	if len(rolloutIDs) == 0 {
		return 2, usageError{errors.New("give the ids of the rollouts whose spans to read")}
	}
	for _, id := range rolloutIDs {
		if err := checkID("rollout_id", id); err != nil {
			return 2, usageError{err}
		}
	}
	out := bufio.NewWriter(os.Stdout)
	reader, err := NewSpanReader(s, schemas, rolloutIDs, out)
	if err != nil {
		return 1, err
	}
	within := time.Duration(timeout * float64(time.Second))
	whole, err := reader.Read(within)
	if err != nil {
		return 1, err
	}
	if !whole {
		return 1, fmt.Errorf("not all there after %v: %s", within, reader.Missing())
	}
	return 0, nil
}

func fingerprints(schemas *Schemas) (int, error) {
	names := make([]string, 0, len(schemas.Current))
	for name := range schemas.Current {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		v := schemas.Current[name]
		fmt.Println(v.Release, v.EventType, v.FingerprintHex())
	}
	for _, v := range schemas.Released {
		fmt.Println(v.Release, v.EventType, v.FingerprintHex())
	}
	return 0, nil
}
