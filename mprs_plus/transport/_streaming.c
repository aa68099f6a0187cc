/* Copies whose destination another process reads: written with non-temporal (streaming)
 * stores, past this core's caches. See streaming.py for why and where. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h> /* SSE2: part of every x86-64 processor, so no runtime check */
#define STREAMING 1
#else
#define STREAMING 0
#endif

/* memcpy's result, with the destination's full 64-byte blocks written by streaming stores.
 * The fence at the end orders them before any later store of this thread (the frame that
 * publishes the bytes): streaming stores are the only x86-64 stores that need one. */
static void copy_streaming(char *dst, const char *src, size_t n) {
#if STREAMING
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}

/* The destination: `nbytes` at `offset` of the writable buffer `out`, checked to fit. */
static char *destination(Py_buffer *out, Py_ssize_t offset, Py_ssize_t nbytes) {
    if (offset < 0 || nbytes < 0 || offset > out->len || nbytes > out->len - offset) {
        PyErr_Format(PyExc_ValueError, "%zd bytes at offset %zd do not fit in a buffer of %zd", nbytes, offset,
                     out->len);
        return NULL;
    }
    return (char *)out->buf + offset;
}

/* copy_into(out, offset, source): the bytes of a C-contiguous buffer into `out` at `offset`.
 * It keeps the GIL, as the slice assignment it replaces in the sender did: no other thread
 * of the sender runs in the middle of a frame's copy. */
static PyObject *copy_into(PyObject *self, PyObject *args) {
    Py_buffer out, source;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "w*ny*", &out, &offset, &source)) {
        return NULL;
    }
    char *dst = destination(&out, offset, source.len);
    if (dst != NULL) {
        copy_streaming(dst, (const char *)source.buf, (size_t)source.len);
    }
    PyBuffer_Release(&source);
    PyBuffer_Release(&out);
    if (dst == NULL) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* copy_from_address(out, offset, address, nbytes): `nbytes` read at a raw address (a live
 * object's memory that exports no buffer, such as a tensor's data) into `out` at `offset`.
 * It releases the GIL, as the torch.stack it replaces in a worker's collate does. */
static PyObject *copy_from_address(PyObject *self, PyObject *args) {
    Py_buffer out;
    Py_ssize_t offset, nbytes;
    unsigned long long address;
    if (!PyArg_ParseTuple(args, "w*nKn", &out, &offset, &address, &nbytes)) {
        return NULL;
    }
    char *dst = destination(&out, offset, nbytes);
    if (dst != NULL) {
        Py_BEGIN_ALLOW_THREADS
        copy_streaming(dst, (const char *)(uintptr_t)address, (size_t)nbytes);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    if (dst == NULL) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_into", copy_into, METH_VARARGS, "Copy a buffer's bytes into out[offset:] with streaming stores."},
    {"copy_from_address", copy_from_address, METH_VARARGS,
     "Copy nbytes read at an address into out[offset:] with streaming stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_streaming", "Streaming-store copies.", -1, methods};

PyMODINIT_FUNC PyInit__streaming(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
