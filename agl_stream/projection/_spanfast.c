/* A SpanRecorded Avro body (the current schema, schemas/SpanRecorded.avsc) read straight into
 * its spans row as one tuple of PostgreSQL's binary COPY format, the four JSON columns as binary
 * jsonb (version byte 1, then the JSON text), with no Python object in between.
 *
 * The projector's hottest path: fastavro's generic reader, the row's Python values and then
 * asyncpg's encoding of them cost most of the projector's CPU per span. This reads the one
 * schema it was written for and makes the checks the event model makes beyond the Avro types
 * (ids of printable ASCII within the id rule's length, times and sequence >= 0, lowercase hex trace and span ids, a canonical UUID
 * event id, times within years 1-9999). Anything it does not take as it is (a malformed body,
 * text that is not strict UTF-8 or holds a NUL, a double that is not finite, a failed check,
 * a value spelled another way the general path accepts, trailing bytes) makes it answer None,
 * and the caller reads the record the general way, which decides and words any refusal. So it
 * never refuses a record itself and never takes one the general path would not: tests hold
 * the two equal on random and on mutated records.
 *
 * decode(data: bytes, offset: int) -> bytes | None: the body starts at `offset`; the columns
 * come in copy_binary.COLUMNS' order (the schema's, with the row's derived times in place).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
} Reader;

typedef struct {
    char *buf;
    Py_ssize_t len;
    Py_ssize_t cap;
} Out;

#define FAIL (-1)

static const char *KIND_NAMES[5] = {"INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER"};
static const char *STATUS_NAMES[3] = {"UNSET", "OK", "ERROR"};

/* ---- output buffer ------------------------------------------------------------------------ */

static int out_reserve(Out *o, Py_ssize_t n) {
    if (o->len + n <= o->cap) return 0;
    Py_ssize_t cap = o->cap ? o->cap : 256;
    while (cap < o->len + n) cap *= 2;
    char *buf = PyMem_Realloc(o->buf, (size_t)cap);
    if (buf == NULL) return FAIL;
    o->buf = buf;
    o->cap = cap;
    return 0;
}

static int out_put(Out *o, const char *s, Py_ssize_t n) {
    if (out_reserve(o, n)) return FAIL;
    memcpy(o->buf + o->len, s, (size_t)n);
    o->len += n;
    return 0;
}

static int out_ch(Out *o, char c) {
    if (out_reserve(o, 1)) return FAIL;
    o->buf[o->len++] = c;
    return 0;
}

/* ---- Avro primitives ---------------------------------------------------------------------- */

static int read_long(Reader *r, int64_t *value) {
    uint64_t n = 0;
    int shift = 0;
    for (;;) {
        if (r->p >= r->end) return FAIL;
        unsigned b = *r->p++;
        if (shift == 63 && b > 1) return FAIL; /* more than 64 bits */
        n |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) break;
        shift += 7;
        if (shift > 63) return FAIL;
    }
    *value = (int64_t)((n >> 1) ^ (~(n & 1) + 1));
    return 0;
}

/* A string's bytes (not yet checked as UTF-8). */
static int read_bytes(Reader *r, const unsigned char **start, Py_ssize_t *size) {
    int64_t n;
    if (read_long(r, &n) || n < 0 || n > (int64_t)(r->end - r->p)) return FAIL;
    *start = r->p;
    *size = (Py_ssize_t)n;
    r->p += n;
    return 0;
}

static int read_enum(Reader *r, int64_t symbols, int64_t *index) {
    if (read_long(r, index) || *index < 0 || *index >= symbols) return FAIL;
    return 0;
}

/* A block count of a map or an array: 0 ends it; a negative one is followed by a byte size. */
static int read_count(Reader *r, int64_t *count) {
    if (read_long(r, count)) return FAIL;
    if (*count < 0) {
        int64_t size;
        if (*count == INT64_MIN || read_long(r, &size)) return FAIL;
        *count = -*count;
    }
    return 0;
}

/* ---- JSON output -------------------------------------------------------------------------- */

/* Length of the well-formed UTF-8 sequence at s (Unicode 15, table 3-7), or 0. */
static int utf8_sequence(const unsigned char *s, const unsigned char *end) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    Py_ssize_t left = end - s;
    if (c >= 0xc2 && c <= 0xdf) return (left >= 2 && (s[1] & 0xc0) == 0x80) ? 2 : 0;
    if (c >= 0xe0 && c <= 0xef) {
        if (left < 3 || (s[2] & 0xc0) != 0x80) return 0;
        unsigned lo = 0x80, hi = 0xbf;
        if (c == 0xe0) lo = 0xa0;
        if (c == 0xed) hi = 0x9f; /* no surrogates */
        return (s[1] >= lo && s[1] <= hi) ? 3 : 0;
    }
    if (c >= 0xf0 && c <= 0xf4) {
        if (left < 4 || (s[2] & 0xc0) != 0x80 || (s[3] & 0xc0) != 0x80) return 0;
        unsigned lo = 0x80, hi = 0xbf;
        if (c == 0xf0) lo = 0x90;
        if (c == 0xf4) hi = 0x8f; /* nothing past U+10FFFF */
        return (s[1] >= lo && s[1] <= hi) ? 4 : 0;
    }
    return 0;
}

static const char HEX[] = "0123456789abcdef";

/* An Avro string as a JSON string. */
static int json_string(Reader *r, Out *o) {
    const unsigned char *s, *end;
    Py_ssize_t n;
    if (read_bytes(r, &s, &n)) return FAIL;
    end = s + n;
    if (out_reserve(o, n + 2) || out_ch(o, '"')) return FAIL;
    const unsigned char *plain = s; /* start of the run not yet copied */
    while (s < end) {
        unsigned c = *s;
        if (c >= 0x20 && c < 0x80 && c != '"' && c != '\\') {
            s++;
            continue;
        }
        if (c >= 0x80) {
            int k = utf8_sequence(s, end);
            if (k == 0) return FAIL;
            s += k;
            continue;
        }
        if (c == 0) return FAIL; /* PostgreSQL's jsonb takes no \u0000: the general path decides */
        if (out_put(o, (const char *)plain, s - plain)) return FAIL;
        if (c == '"' || c == '\\') {
            char escaped[2] = {'\\', (char)c};
            if (out_put(o, escaped, 2)) return FAIL;
        } else {
            char escaped[6] = {'\\', 'u', '0', '0', HEX[c >> 4], HEX[c & 15]};
            if (out_put(o, escaped, 6)) return FAIL;
        }
        s++;
        plain = s;
    }
    if (out_put(o, (const char *)plain, s - plain)) return FAIL;
    return out_ch(o, '"');
}

static int json_long(Reader *r, Out *o) {
    int64_t v;
    char text[24];
    if (read_long(r, &v)) return FAIL;
    int n = snprintf(text, sizeof text, "%lld", (long long)v);
    return out_put(o, text, n);
}

static int json_double(Reader *r, Out *o) {
    if (r->end - r->p < 8) return FAIL;
    uint64_t bits = 0;
    for (int i = 7; i >= 0; i--) bits = (bits << 8) | r->p[i];
    r->p += 8;
    double d;
    memcpy(&d, &bits, 8);
    if (!isfinite(d)) return FAIL; /* JSON has no NaN or infinity: the general path decides */
    /* Python's repr: the shortest text that reads back as the same double. */
    char *text = PyOS_double_to_string(d, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (text == NULL) {
        PyErr_Clear();
        return FAIL;
    }
    int failed = out_put(o, text, (Py_ssize_t)strlen(text));
    PyMem_Free(text);
    return failed;
}

static int json_boolean(Reader *r, Out *o) {
    if (r->p >= r->end || *r->p > 1) return FAIL;
    return (*r->p++) ? out_put(o, "true", 4) : out_put(o, "false", 5);
}

/* One of null, boolean, long, double, string (union indexes 0-4). */
static int json_scalar(Reader *r, Out *o, int64_t index) {
    switch (index) {
        case 0: return out_put(o, "null", 4);
        case 1: return json_boolean(r, o);
        case 2: return json_long(r, o);
        case 3: return json_double(r, o);
        case 4: return json_string(r, o);
        default: return FAIL;
    }
}

/* A map's or an array's blocks as a JSON object or array, each item written by `item`. */
typedef int (*ItemWriter)(Reader *, Out *);

static int json_blocks(Reader *r, Out *o, char open, char close, ItemWriter item) {
    int64_t count;
    int first = 1;
    if (out_ch(o, open)) return FAIL;
    for (;;) {
        if (read_count(r, &count)) return FAIL;
        if (count == 0) break;
        for (int64_t i = 0; i < count; i++) {
            if (!first && out_ch(o, ',')) return FAIL;
            first = 0;
            if (item(r, o)) return FAIL;
        }
    }
    return out_ch(o, close);
}

/* An item of an attribute's array: one of the scalars. */
static int array_item(Reader *r, Out *o) {
    int64_t index;
    return read_long(r, &index) || index > 4 || json_scalar(r, o, index);
}

/* An attribute value: a scalar, or (index 5) an array of scalars. */
static int json_value(Reader *r, Out *o) {
    int64_t index;
    if (read_long(r, &index)) return FAIL;
    if (index != 5) return json_scalar(r, o, index);
    return json_blocks(r, o, '[', ']', array_item);
}

static int attribute_item(Reader *r, Out *o) {
    return json_string(r, o) || out_ch(o, ':') || json_value(r, o);
}

/* An attributes map as a JSON object. */
static int json_attributes(Reader *r, Out *o) {
    return json_blocks(r, o, '{', '}', attribute_item);
}

/* ---- the record's JSON arrays ----------------------------------------------------------- */

static int is_hex(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
}

/* A string of exactly `digits` lowercase hex digits: its bytes. */
static int read_hex(Reader *r, Py_ssize_t digits, const unsigned char **start) {
    Py_ssize_t n;
    if (read_bytes(r, start, &n) || n != digits) return FAIL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!is_hex((*start)[i])) return FAIL;
    }
    return 0;
}

/* A span event as JSON; FAIL where its time is negative. */
static int event_item(Reader *r, Out *o) {
    int64_t time;
    char text[48];
    if (out_put(o, "{\"name\":", 8) || json_string(r, o)) return FAIL;
    if (read_long(r, &time) || time < 0) return FAIL;
    int n = snprintf(text, sizeof text, ",\"time_unix_nano\":%lld", (long long)time);
    return out_put(o, text, n) || out_put(o, ",\"attributes\":", 14) ||
           json_attributes(r, o) || out_ch(o, '}');
}

static int json_events(Reader *r, Out *o) {
    return json_blocks(r, o, '[', ']', event_item);
}

/* A span link as JSON; FAIL where its ids are not lowercase hex. */
static int link_item(Reader *r, Out *o) {
    const unsigned char *unused;
    Reader ids = *r;
    if (read_hex(&ids, 32, &unused) || read_hex(&ids, 16, &unused)) return FAIL;
    return out_put(o, "{\"trace_id\":", 12) || json_string(r, o) ||
           out_put(o, ",\"span_id\":", 11) || json_string(r, o) ||
           out_put(o, ",\"attributes\":", 14) || json_attributes(r, o) || out_ch(o, '}');
}

static int json_links(Reader *r, Out *o) {
    return json_blocks(r, o, '[', ']', link_item);
}

/* ---- binary COPY fields ------------------------------------------------------------------- */

static int put_be(Out *o, uint64_t value, int bytes) {
    if (out_reserve(o, bytes)) return FAIL;
    for (int i = bytes - 1; i >= 0; i--) o->buf[o->len++] = (char)((value >> (8 * i)) & 0xff);
    return 0;
}

static int put_null(Out *o) {
    return put_be(o, 0xffffffffu, 4);
}

static int put_field(Out *o, const void *data, Py_ssize_t n) {
    if (n > INT32_MAX || put_be(o, (uint64_t)n, 4)) return FAIL;
    return out_put(o, (const char *)data, n);
}

static int put_int8(Out *o, int64_t value) {
    return put_be(o, 8, 4) || put_be(o, (uint64_t)value, 8);
}

/* Strict UTF-8 without NUL (PostgreSQL's text holds none). */
static int text_ok(const unsigned char *s, Py_ssize_t n) {
    const unsigned char *end = s + n;
    while (s < end) {
        if (*s == 0) return 0;
        int k = utf8_sequence(s, end);
        if (k == 0) return 0;
        s += k;
    }
    return 1;
}

/* A string column; `nonempty` refuses "". */
static int text_field(Reader *r, Out *o, int nonempty) {
    const unsigned char *s;
    Py_ssize_t n;
    if (read_bytes(r, &s, &n) || (nonempty && n == 0) || !text_ok(s, n)) return FAIL;
    return put_field(o, s, n);
}

/* An id column (events/ids.py: 1 to 256 printable characters). Only printable ASCII is taken
 * here; anything else steps aside to the general path, which applies the whole rule. */
#define MAX_ID_LENGTH 256
static int id_field(Reader *r, Out *o) {
    const unsigned char *s;
    Py_ssize_t n;
    if (read_bytes(r, &s, &n) || n == 0 || n > MAX_ID_LENGTH) return FAIL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < 0x20 || s[i] > 0x7e) return FAIL;
    }
    return put_field(o, s, n);
}

/* A ["null", "string"] column. */
static int optional_text_field(Reader *r, Out *o) {
    int64_t index;
    if (read_long(r, &index)) return FAIL;
    if (index == 0) return put_null(o);
    if (index == 1) return text_field(r, o, 0);
    return FAIL;
}

static int hex_field(Reader *r, Out *o, Py_ssize_t digits) {
    const unsigned char *s;
    return read_hex(r, digits, &s) || put_field(o, s, digits);
}

static int hex_value(unsigned char c) {
    return c <= '9' ? c - '0' : c - 'a' + 10;
}

/* A UUID in its canonical text as PostgreSQL's binary uuid; other spellings step aside. */
static int uuid_field(Reader *r, Out *o) {
    const unsigned char *s;
    Py_ssize_t n;
    unsigned char bytes[16];
    if (read_bytes(r, &s, &n) || n != 36) return FAIL;
    for (int i = 0, k = 0; i < 36; i++) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (s[i] != '-') return FAIL;
            continue;
        }
        if (!is_hex(s[i]) || !is_hex(s[i + 1])) return FAIL;
        bytes[k++] = (unsigned char)(hex_value(s[i]) << 4 | hex_value(s[i + 1]));
        i++;
    }
    return put_field(o, bytes, 16);
}

/* Microseconds since the Unix epoch as PostgreSQL's binary timestamptz (microseconds since
 * 2000-01-01 UTC); FAIL outside years 1-9999, where the general path's datetimes end. */
static int timestamp_field(Out *o, int64_t micros) {
    if (micros < -62135596800000000LL || micros >= 253402300800000000LL) return FAIL;
    return put_int8(o, micros - 946684800000000LL);
}

static int symbol_field(Out *o, const char *symbol) {
    return put_field(o, symbol, (Py_ssize_t)strlen(symbol));
}

/* A JSON column: its length is written once the JSON is. */
typedef int (*JsonWriter)(Reader *, Out *);

static int jsonb_field(Reader *r, Out *o, JsonWriter write) {
    Py_ssize_t at = o->len;
    if (put_be(o, 0, 4) || out_ch(o, 1) || write(r, o)) return FAIL;
    Py_ssize_t n = o->len - at - 4;
    if (n > INT32_MAX) return FAIL;
    for (int i = 0; i < 4; i++) o->buf[at + i] = (char)((n >> (8 * (3 - i))) & 0xff);
    return 0;
}

/* ---- the record --------------------------------------------------------------------------- */

#define FIELDS 21

static int row(Reader *r, Out *o) {
    int64_t occurred_at, sequence, start, end, kind, code;
    if (put_be(o, FIELDS, 2)) return FAIL;
    if (uuid_field(r, o)) return FAIL;                                    /* event_id */
    if (read_long(r, &occurred_at) || timestamp_field(o, occurred_at)) return FAIL; /* recorded_at */
    if (id_field(r, o) || id_field(r, o)) return FAIL;                    /* rollout_id, attempt_id */
    if (read_long(r, &sequence) || sequence < 0 || put_int8(o, sequence)) return FAIL;
    if (hex_field(r, o, 32) || hex_field(r, o, 16)) return FAIL;        /* trace_id, span_id */
    int64_t index;
    if (read_long(r, &index)) return FAIL;                                /* parent_span_id */
    if (index == 0 ? put_null(o) : index == 1 ? hex_field(r, o, 16) : FAIL) return FAIL;
    if (text_field(r, o, 0)) return FAIL;                                 /* name */
    if (read_enum(r, 5, &kind) || symbol_field(o, KIND_NAMES[kind])) return FAIL;
    if (read_long(r, &start) || read_long(r, &end) || start < 0 || end < 0) return FAIL;
    if (timestamp_field(o, start / 1000) || timestamp_field(o, end / 1000)) return FAIL;
    if (put_int8(o, start) || put_int8(o, end)) return FAIL;
    if (read_enum(r, 3, &code) || symbol_field(o, STATUS_NAMES[code])) return FAIL;
    if (optional_text_field(r, o)) return FAIL;                           /* status description */
    if (jsonb_field(r, o, json_attributes) || jsonb_field(r, o, json_events)) return FAIL;
    if (jsonb_field(r, o, json_links) || jsonb_field(r, o, json_attributes)) return FAIL;
    if (optional_text_field(r, o)) return FAIL;                           /* scope_name */
    return r->p == r->end ? 0 : FAIL;                                     /* no trailing bytes */
}

static PyObject *decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "decode(data: bytes, offset: int)");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    if (offset < 0 || offset > size) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "offset outside the data");
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Reader r = {data + offset, data + size};
    Out o = {NULL, 0, 0};
    PyObject *result;
    if (out_reserve(&o, 2 * (size - offset) + 256)) {
        result = PyErr_NoMemory();
    } else if (row(&r, &o)) {
        PyErr_Clear(); /* only a double's formatting can set one; step aside */
        result = Py_NewRef(Py_None);
    } else {
        result = PyBytes_FromStringAndSize(o.buf, o.len);
    }
    PyMem_Free(o.buf);
    return result;
}

static PyMethodDef METHODS[] = {
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL,
     "decode(data, offset) -> a SpanRecorded body as a binary COPY tuple of its spans row, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_spanfast", "SpanRecorded Avro bodies to spans rows.", -1, METHODS,
};

PyMODINIT_FUNC PyInit__spanfast(void) {
    return PyModule_Create(&MODULE);
}
