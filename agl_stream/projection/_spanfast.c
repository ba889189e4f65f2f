/* A SpanRecorded Avro body (the current schema, schemas/SpanRecorded.avsc) read straight into
 * the values of its spans row, with the four JSON columns written as PostgreSQL's binary jsonb
 * (version byte 1, then the JSON text) without Python dicts in between.
 *
 * The projector's hottest path: fastavro's generic reader and then orjson cost most of the
 * projector's CPU per span. This reads the one schema it was written for; anything it does
 * not take as it is (a malformed body, text that is not strict UTF-8, a NUL in JSON text, a
 * double that is not finite, trailing bytes) makes it answer None, and the caller reads the
 * record the general way, which decides and words any refusal. So it never refuses a record
 * itself and never accepts one the general path would not: tests hold the two equal on random
 * and on mutated records.
 *
 * It also makes the checks the event model makes beyond the Avro types (non-empty ids, times
 * and sequence >= 0, lowercase hex trace and span ids, a canonical UUID event id, times within
 * the calendar) and steps aside where one fails or a value is spelled another way the general
 * path accepts (an event id in capitals, say).
 *
 * decode(data: bytes, offset: int) -> tuple | None: the body starts at `offset`; the tuple holds
 * the spans row's values in the order of its columns (rows.SpanRow).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <datetime.h>
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

static PyObject *KIND[5];
static PyObject *STATUS[3];
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

/* A Python str, or NULL (no exception set) where the bytes are not strict UTF-8. */
static PyObject *read_str(Reader *r) {
    const unsigned char *s;
    Py_ssize_t n;
    if (read_bytes(r, &s, &n)) return NULL;
    PyObject *text = PyUnicode_DecodeUTF8((const char *)s, n, "strict");
    if (text == NULL) PyErr_Clear();
    return text;
}

/* null or a string (the union ["null", "string"]): Py_None (new reference) or a str. */
static PyObject *read_optional_str(Reader *r) {
    int64_t index;
    if (read_long(r, &index)) return NULL;
    if (index == 0) Py_RETURN_NONE;
    if (index == 1) return read_str(r);
    return NULL;
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

/* An attribute value: a scalar, or (index 5) an array of scalars. */
static int json_value(Reader *r, Out *o) {
    int64_t index, count;
    if (read_long(r, &index)) return FAIL;
    if (index != 5) return json_scalar(r, o, index);
    if (out_ch(o, '[')) return FAIL;
    int first = 1;
    for (;;) {
        if (read_count(r, &count)) return FAIL;
        if (count == 0) break;
        for (int64_t i = 0; i < count; i++) {
            int64_t item;
            if (!first && out_ch(o, ',')) return FAIL;
            first = 0;
            if (read_long(r, &item) || item > 4 || json_scalar(r, o, item)) return FAIL;
        }
    }
    return out_ch(o, ']');
}

/* An attributes map as a JSON object. */
static int json_attributes(Reader *r, Out *o) {
    int64_t count;
    int first = 1;
    if (out_ch(o, '{')) return FAIL;
    for (;;) {
        if (read_count(r, &count)) return FAIL;
        if (count == 0) break;
        for (int64_t i = 0; i < count; i++) {
            if (!first && out_ch(o, ',')) return FAIL;
            first = 0;
            if (json_string(r, o) || out_ch(o, ':') || json_value(r, o)) return FAIL;
        }
    }
    return out_ch(o, '}');
}

static int read_hex(Reader *r, Py_ssize_t digits, PyObject **text);

/* ---- the record --------------------------------------------------------------------------- */

static PyObject *jsonb(Out *o) {
    return PyBytes_FromStringAndSize(o->buf, o->len);
}

/* The events array as JSON; FAIL where an event's time is negative. */
static int json_events(Reader *r, Out *o) {
    int64_t count, time;
    int first = 1;
    if (out_put(o, "\x01[", 2)) return FAIL;
    for (;;) {
        if (read_count(r, &count)) return FAIL;
        if (count == 0) break;
        for (int64_t i = 0; i < count; i++) {
            if (!first && out_ch(o, ',')) return FAIL;
            first = 0;
            if (out_put(o, "{\"name\":", 8) || json_string(r, o)) return FAIL;
            if (read_long(r, &time) || time < 0) return FAIL;
            char text[48];
            int n = snprintf(text, sizeof text, ",\"time_unix_nano\":%lld", (long long)time);
            if (out_put(o, text, n)) return FAIL;
            if (out_put(o, ",\"attributes\":", 14) || json_attributes(r, o) || out_ch(o, '}'))
                return FAIL;
        }
    }
    return out_ch(o, ']');
}

/* The links array as JSON; FAIL where a link's ids are not lowercase hex. */
static int json_links(Reader *r, Out *o) {
    int64_t count;
    int first = 1;
    if (out_put(o, "\x01[", 2)) return FAIL;
    for (;;) {
        if (read_count(r, &count)) return FAIL;
        if (count == 0) break;
        for (int64_t i = 0; i < count; i++) {
            if (!first && out_ch(o, ',')) return FAIL;
            first = 0;
            Reader ids = *r;
            if (read_hex(&ids, 32, NULL) || read_hex(&ids, 16, NULL)) return FAIL;
            if (out_put(o, "{\"trace_id\":", 12) || json_string(r, o)) return FAIL;
            if (out_put(o, ",\"span_id\":", 11) || json_string(r, o)) return FAIL;
            if (out_put(o, ",\"attributes\":", 14) || json_attributes(r, o) || out_ch(o, '}'))
                return FAIL;
        }
    }
    return out_ch(o, ']');
}

/* ---- the checks ---------------------------------------------------------------------------- */

static int is_hex(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
}

/* A string of exactly `digits` lowercase hex digits; as a str in *text unless text is NULL. */
static int read_hex(Reader *r, Py_ssize_t digits, PyObject **text) {
    const unsigned char *s;
    Py_ssize_t n;
    if (read_bytes(r, &s, &n) || n != digits) return FAIL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!is_hex(s[i])) return FAIL;
    }
    if (text != NULL && (*text = PyUnicode_FromStringAndSize((const char *)s, n)) == NULL)
        return FAIL;
    return 0;
}

/* A UUID in its canonical text (what PostgreSQL reads as it is); other spellings step aside. */
static PyObject *read_canonical_uuid(Reader *r) {
    const unsigned char *s;
    Py_ssize_t n;
    if (read_bytes(r, &s, &n) || n != 36) return NULL;
    for (int i = 0; i < 36; i++) {
        int dash = i == 8 || i == 13 || i == 18 || i == 23;
        if (dash ? s[i] != '-' : !is_hex(s[i])) return NULL;
    }
    return PyUnicode_FromStringAndSize((const char *)s, n);
}

/* A non-empty string. */
static PyObject *read_nonempty_str(Reader *r) {
    Reader at = *r;
    int64_t n;
    if (read_long(&at, &n) || n <= 0) return NULL;
    return read_str(r);
}

static int64_t floor_div(int64_t a, int64_t b, int64_t *rest) {
    int64_t q = a / b, m = a % b;
    if (m < 0) {
        m += b;
        q -= 1;
    }
    *rest = m;
    return q;
}

/* Microseconds since the epoch as an aware UTC datetime; NULL (no exception) outside years
 * 1-9999, where the general path's datetime arithmetic overflows. */
static PyObject *utc_datetime(int64_t micros) {
    int64_t us, seconds, days = floor_div(floor_div(micros, 1000000, &us), 86400, &seconds);
    /* civil_from_days (H. Hinnant): the proleptic Gregorian date of a day number. */
    int64_t z = days + 719468;
    int64_t era = (z >= 0 ? z : z - 146096) / 146097;
    int64_t doe = z - era * 146097;
    int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    int64_t mp = (5 * doy + 2) / 153;
    int64_t day = doy - (153 * mp + 2) / 5 + 1;
    int64_t month = mp < 10 ? mp + 3 : mp - 9;
    int64_t year = yoe + era * 400 + (month <= 2);
    if (year < 1 || year > 9999) return NULL;
    PyObject *at = PyDateTimeAPI->DateTime_FromDateAndTime(
        (int)year, (int)month, (int)day, (int)(seconds / 3600), (int)(seconds / 60 % 60),
        (int)(seconds % 60), (int)us, PyDateTime_TimeZone_UTC, PyDateTimeAPI->DateTimeType);
    if (at == NULL) PyErr_Clear();
    return at;
}

#define FIELDS 21

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
    PyObject *v[FIELDS] = {NULL};
    Out o = {NULL, 0, 0};
    int64_t n, index, occurred_at, start, end;

#define TAKE(i, value)                                                                          \
    if ((v[i] = (value)) == NULL) goto refuse
#define JSON(i, write)                                                                          \
    o.len = 0;                                                                                  \
    if ((write) || (v[i] = jsonb(&o)) == NULL) goto refuse

    /* In the order of the schema's fields; v[] is in the order of the row's columns. */
    TAKE(3, read_canonical_uuid(&r));                      /* event_id */
    if (read_long(&r, &occurred_at)) goto refuse;
    TAKE(4, utc_datetime(occurred_at));                    /* recorded_at */
    TAKE(0, read_nonempty_str(&r));                        /* rollout_id */
    TAKE(1, read_nonempty_str(&r));                        /* attempt_id */
    if (read_long(&r, &n) || n < 0) goto refuse;
    TAKE(2, PyLong_FromLongLong(n));                       /* sequence */
    if (read_hex(&r, 32, &v[5]) || read_hex(&r, 16, &v[6])) goto refuse; /* trace, span ids */
    if (read_long(&r, &index) || index < 0 || index > 1) goto refuse;
    if (index == 0) {
        v[7] = Py_NewRef(Py_None);                         /* parent_span_id */
    } else if (read_hex(&r, 16, &v[7])) {
        goto refuse;
    }
    TAKE(8, read_str(&r));                                 /* name */
    if (read_enum(&r, 5, &index)) goto refuse;
    v[9] = Py_NewRef(KIND[index]);                         /* kind */
    if (read_long(&r, &start) || read_long(&r, &end) || start < 0 || end < 0) goto refuse;
    TAKE(10, utc_datetime(start / 1000));                  /* start_time */
    TAKE(11, utc_datetime(end / 1000));                    /* end_time */
    TAKE(12, PyLong_FromLongLong(start));
    TAKE(13, PyLong_FromLongLong(end));
    if (read_enum(&r, 3, &index)) goto refuse;
    v[14] = Py_NewRef(STATUS[index]);                      /* status_code */
    TAKE(15, read_optional_str(&r));                       /* status_description */
    JSON(16, out_ch(&o, 1) || json_attributes(&r, &o));
    JSON(17, json_events(&r, &o));
    JSON(18, json_links(&r, &o));
    JSON(19, out_ch(&o, 1) || json_attributes(&r, &o));  /* resource */
    TAKE(20, read_optional_str(&r));                       /* scope_name */
    if (r.p != r.end) goto refuse;                         /* trailing bytes */

    PyObject *result = PyTuple_New(FIELDS);
    if (result != NULL) {
        for (int i = 0; i < FIELDS; i++) PyTuple_SET_ITEM(result, i, v[i]);
    }
    PyMem_Free(o.buf);
    return result; /* NULL only on MemoryError */

refuse:
    for (int i = 0; i < FIELDS; i++) Py_XDECREF(v[i]);
    PyMem_Free(o.buf);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_MemoryError)) PyErr_Clear();
        else return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef METHODS[] = {
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL,
     "decode(data, offset) -> the spans row's values of a SpanRecorded body, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_spanfast", "SpanRecorded Avro bodies to spans rows.", -1, METHODS,
};

PyMODINIT_FUNC PyInit__spanfast(void) {
    PyDateTime_IMPORT;
    if (PyDateTimeAPI == NULL) return NULL;
    for (int i = 0; i < 5; i++) {
        if ((KIND[i] = PyUnicode_InternFromString(KIND_NAMES[i])) == NULL) return NULL;
    }
    for (int i = 0; i < 3; i++) {
        if ((STATUS[i] = PyUnicode_InternFromString(STATUS_NAMES[i])) == NULL) return NULL;
    }
    return PyModule_Create(&MODULE);
}
