/* Native lane sums of the trainscout fingerprint (spec.md beside this file defines them; cpu.py is the
 * reference this must equal bit for bit).
 *
 * For n little-endian uint32 words whose first word has global index `word_base`, returns (S_A, S_B) mod
 * 2^32 with
 *     S_A = sum mixA(w_k + tA(i)),  tA(i) = lo*K_A + hi*H_A
 *     S_B = sum mixB(w_k + tB(i)),  tB(i) = lo*K_B + hi*H_B + C_B,   i = word_base + k, lo/hi its halves.
 * The buffer is cut where the global index crosses a multiple of 2^32, so hi is constant in each piece and
 * the tweaks advance by K_A / K_B per word. The inner loop is plain uint32 arithmetic without branches,
 * written for gcc's (and clang's) auto-vectoriser. On x86-64 it is compiled three times through target
 * attributes (baseline SSE2, which has no 32-bit vector multiply; SSE4.1; AVX2) and the best variant the CPU
 * and OS support is picked once at import, so one binary runs on any x86-64 machine. Explicit dispatch
 * rather than target_clones: no ifunc (works without glibc), and tests can run every variant. An AVX-512
 * variant measured the same as AVX2 (both at memory speed, ~15-17 GB/s on one core of the development
 * machine), so there is none. Elsewhere (aarch64: NEON is baseline) only the default variant exists.
 * The GIL is released while large buffers are summed.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* Bumped whenever the module's interface or results change; cpu.py refuses a module built from another
 * version (a stale in-place build left behind by an editable install) and uses numpy instead. */
#define TS_API_VERSION 1

#define TS_K_A 0x9E3779B1u
#define TS_H_A 0x7FEB352Du
#define TS_K_B 0x27D4EB2Fu
#define TS_H_B 0x846CA68Au
#define TS_C_B 0x165667B1u
#define TS_A_MUL1 0x85EBCA6Bu
#define TS_A_MUL2 0xC2B2AE35u
#define TS_B_MUL1 0x85EBCA77u
#define TS_B_MUL2 0xC2B2AE3Du

/* Below this many words the GIL is kept: the sum takes microseconds, while taking the GIL back after
 * releasing it can wait a whole switch interval (5 ms) when other Python threads are busy. */
#define TS_RELEASE_GIL_WORDS 16384

#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define TS_LE32(x) __builtin_bswap32(x)
#else
#define TS_LE32(x) (x)
#endif

/* One piece that does not cross a 2^32 boundary of the global index: ta/tb are the tweaks of its first
 * word. memcpy makes the load alignment-free (numpy views of byte buffers may be unaligned); compilers
 * turn it into one (vector) load. Sums wrap mod 2^32, as the definition wants. */
#define TS_DEFINE_KERNEL(NAME, ATTRS)                                                                   \
    ATTRS static void NAME(const unsigned char *p, size_t n, uint32_t ta, uint32_t tb, uint32_t *out_a, \
                           uint32_t *out_b)                                                            \
    {                                                                                                  \
        uint32_t sa = 0, sb = 0;                                                                       \
        for (size_t j = 0; j < n; j++) {                                                               \
            uint32_t w;                                                                                \
            memcpy(&w, p + 4 * j, 4);                                                                  \
            w = TS_LE32(w);                                                                            \
            uint32_t a = w + ta;                                                                       \
            uint32_t b = w + tb;                                                                       \
            a ^= a >> 16;                                                                              \
            a *= TS_A_MUL1;                                                                            \
            a ^= a >> 13;                                                                              \
            a *= TS_A_MUL2;                                                                            \
            a ^= a >> 16;                                                                              \
            b ^= b >> 15;                                                                              \
            b *= TS_B_MUL1;                                                                            \
            b ^= b >> 13;                                                                              \
            b *= TS_B_MUL2;                                                                            \
            b ^= b >> 16;                                                                              \
            sa += a;                                                                                   \
            sb += b;                                                                                   \
            ta += TS_K_A;                                                                              \
            tb += TS_K_B;                                                                              \
        }                                                                                              \
        *out_a += sa;                                                                                  \
        *out_b += sb;                                                                                  \
    }

typedef void (*ts_kernel_fn)(const unsigned char *, size_t, uint32_t, uint32_t, uint32_t *, uint32_t *);

TS_DEFINE_KERNEL(ts_kernel_default, )

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(TS_NO_X86_VARIANTS)
#define TS_X86_VARIANTS 1
TS_DEFINE_KERNEL(ts_kernel_avx2, __attribute__((target("avx2"))))
TS_DEFINE_KERNEL(ts_kernel_sse41, __attribute__((target("sse4.1"))))
#endif

typedef struct {
    const char *name;
    ts_kernel_fn fn;
    int supported; /* by this CPU and OS, decided at import */
} ts_variant;

/* Best first. */
static ts_variant ts_variants[] = {
#ifdef TS_X86_VARIANTS
    {"avx2", ts_kernel_avx2, 0},
    {"sse4.1", ts_kernel_sse41, 0},
#endif
    {"default", ts_kernel_default, 1},
};
#define TS_N_VARIANTS ((int)(sizeof(ts_variants) / sizeof(ts_variants[0])))

static int ts_active = TS_N_VARIANTS - 1;

static void ts_detect(void)
{
#ifdef TS_X86_VARIANTS
    /* libgcc / compiler-rt check both the CPUID bits and that the OS saves the vector state (XCR0). */
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2");
    int sse41 = __builtin_cpu_supports("sse4.1");
    for (int v = 0; v < TS_N_VARIANTS; v++) {
        if (strcmp(ts_variants[v].name, "avx2") == 0)
            ts_variants[v].supported = avx2;
        else if (strcmp(ts_variants[v].name, "sse4.1") == 0)
            ts_variants[v].supported = sse41;
    }
#endif
    ts_active = TS_N_VARIANTS - 1;
    for (int v = 0; v < TS_N_VARIANTS; v++) {
        if (ts_variants[v].supported) {
            ts_active = v;
            break;
        }
    }
}

/* All pieces of [word_base, word_base + n): hi(i) is constant inside each one. */
static void ts_lane_sums(ts_kernel_fn fn, const unsigned char *p, size_t n, uint64_t word_base, uint32_t *sa,
                         uint32_t *sb)
{
    uint64_t i = word_base;
    while (n > 0) {
        uint32_t lo = (uint32_t)i;
        uint32_t hi = (uint32_t)(i >> 32);
        uint64_t to_boundary = ((uint64_t)1 << 32) - lo;
        size_t m = (uint64_t)n < to_boundary ? n : (size_t)to_boundary;
        uint32_t ta = lo * TS_K_A + hi * TS_H_A;
        uint32_t tb = lo * TS_K_B + hi * TS_H_B + TS_C_B;
        fn(p, m, ta, tb, sa, sb);
        p += 4 * m;
        n -= m;
        i += m;
    }
}

static int ts_find_variant(const char *name)
{
    for (int v = 0; v < TS_N_VARIANTS; v++) {
        if (strcmp(ts_variants[v].name, name) == 0)
            return v;
    }
    return -1;
}

PyDoc_STRVAR(lane_sums_doc,
             "lane_sums(buffer, word_base, variant=None) -> (S_A, S_B)\n\n"
             "Lane sums mod 2^32 of a C-contiguous buffer of little-endian uint32 words (its length a\n"
             "multiple of 4) whose first word has global index word_base (0 <= word_base, and the last\n"
             "index below 2^64). variant names a compiled kernel (see variants()); None uses the active one.");

static PyObject *ts_py_lane_sums(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buffer", "word_base", "variant", NULL};
    Py_buffer view;
    PyObject *base_obj;
    const char *variant = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*O|z:lane_sums", kwlist, &view, &base_obj, &variant))
        return NULL;
    unsigned long long word_base = PyLong_AsUnsignedLongLong(base_obj);
    if (word_base == (unsigned long long)-1 && PyErr_Occurred()) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (view.len % 4 != 0) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "buffer length %zd is not a multiple of 4", view.len);
        return NULL;
    }
    size_t n = (size_t)view.len / 4;
    if (n > 0 && (uint64_t)word_base > UINT64_MAX - (uint64_t)(n - 1)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_OverflowError, "word_base + n - 1 does not fit in 64 bits");
        return NULL;
    }
    int v = ts_active;
    if (variant != NULL) {
        v = ts_find_variant(variant);
        if (v < 0 || !ts_variants[v].supported) {
            PyBuffer_Release(&view);
            PyErr_Format(PyExc_ValueError, "kernel variant %s is %s", variant,
                         v < 0 ? "not compiled in" : "not supported by this CPU");
            return NULL;
        }
    }
    ts_kernel_fn fn = ts_variants[v].fn;
    uint32_t sa = 0, sb = 0;
    const unsigned char *p = (const unsigned char *)view.buf;
    if (n >= TS_RELEASE_GIL_WORDS) {
        Py_BEGIN_ALLOW_THREADS
        ts_lane_sums(fn, p, n, (uint64_t)word_base, &sa, &sb);
        Py_END_ALLOW_THREADS
    }
    else {
        ts_lane_sums(fn, p, n, (uint64_t)word_base, &sa, &sb);
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(kk)", (unsigned long)sa, (unsigned long)sb);
}

PyDoc_STRVAR(variants_doc, "variants() -> list of the kernel variants this CPU supports, best first.");

static PyObject *ts_py_variants(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (int v = 0; v < TS_N_VARIANTS; v++) {
        if (!ts_variants[v].supported)
            continue;
        PyObject *name = PyUnicode_FromString(ts_variants[v].name);
        if (name == NULL || PyList_Append(out, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(name);
    }
    return out;
}

PyDoc_STRVAR(variant_doc, "variant() -> the kernel variant lane_sums uses when none is named.");

static PyObject *ts_py_variant(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyUnicode_FromString(ts_variants[ts_active].name);
}

PyDoc_STRVAR(set_variant_doc,
             "set_variant(name) -> previous name. Picks the kernel variant (for tests and benchmarks);\n"
             "None picks the best supported one again.");

static PyObject *ts_py_set_variant(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *previous = PyUnicode_FromString(ts_variants[ts_active].name);
    if (previous == NULL)
        return NULL;
    if (arg == Py_None) {
        ts_detect();
        return previous;
    }
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) {
        Py_DECREF(previous);
        return NULL;
    }
    int v = ts_find_variant(name);
    if (v < 0 || !ts_variants[v].supported) {
        Py_DECREF(previous);
        PyErr_Format(PyExc_ValueError, "kernel variant %s is %s", name,
                     v < 0 ? "not compiled in" : "not supported by this CPU");
        return NULL;
    }
    ts_active = v;
    return previous;
}

static PyMethodDef ts_methods[] = {
    {"lane_sums", (PyCFunction)(void (*)(void))ts_py_lane_sums, METH_VARARGS | METH_KEYWORDS, lane_sums_doc},
    {"variants", ts_py_variants, METH_NOARGS, variants_doc},
    {"variant", ts_py_variant, METH_NOARGS, variant_doc},
    {"set_variant", ts_py_set_variant, METH_O, set_variant_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ts_module = {
    PyModuleDef_HEAD_INIT,
    "_native",
    "Native lane sums of the trainscout fingerprint (spec.md); cpu.py is the reference and the fallback.",
    -1,
    ts_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    ts_detect();
    PyObject *m = PyModule_Create(&ts_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "API_VERSION", TS_API_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "RELEASE_GIL_WORDS", TS_RELEASE_GIL_WORDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
