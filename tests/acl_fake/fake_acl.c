/*
 * A fake CANN runtime for testing fastgrad's "acl" backend against the ABI, on a machine
 * without an NPU.
 *
 * It exports the C symbols the aclnn samples use, with the signatures of
 * fastgrad/backends/aclnn_prototypes.h -- the same table the backend's ctypes prototypes are
 * parsed from; it is #included below, so a definition here that disagrees with it is a compile
 * error ("conflicting types") -- split over three shared objects as in a real toolkit:
 *
 *   libascendcl.so  (-DFAKE_PART_ACL)       aclInit, aclrt*, aclGetRecentErrMsg + the fake_*
 *                                           query API and all shared state
 *   libnnopbase.so  (-DFAKE_PART_NNOPBASE)  aclCreateTensor, aclDestroyTensor,
 *                                           aclDestroyAclOpExecutor
 *   libopapi.so     (-DFAKE_PART_OPAPI)     aclnnXxxGetWorkspaceSize / aclnnXxx for the seven ops
 *
 * "Device" memory is host memory from malloc, tracked so that every aclrtMalloc/aclrtFree,
 * aclCreateTensor/aclDestroyTensor and executor can be accounted for.  Every call and its
 * arguments are appended to a JSON log (fake_log_json()).  Protocol violations (use before
 * aclInit, unknown or double frees, out-of-range copies, a tensor whose view reaches outside
 * its device allocation, a workspace size different from the one stage one returned, a
 * foreign stream, ...) are counted (fake_counter("violations")) and described
 * (fake_last_violation()).  Each op is computed on the host in double precision, when the
 * stream is synchronized (not before: reading results before aclrtSynchronizeStream gives
 * stale data, as on the device).  Any call can be told to fail with a given status code
 * (fake_fail()).
 *
 * This is test scaffolding, not a golden: results are the SPEC formulas in double, rounded
 * once to the output dtype.
 */
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FAKE_API __attribute__((visibility("default")))
#define MAXD 8
#define TENSOR_MAGIC 0x7E45A11Cu
#define EXEC_MAGIC 0xE8EC0001u
#define STREAM_MAGIC 0x57EA0001u
#define MAXT 12

/* aclDataType values (acl_base.h) */
enum { DT_FLOAT = 0, DT_FLOAT16 = 1, DT_INT8 = 2, DT_INT32 = 3, DT_UINT8 = 4, DT_INT16 = 6,
       DT_UINT16 = 7, DT_UINT32 = 8, DT_INT64 = 9, DT_UINT64 = 10, DT_DOUBLE = 11, DT_BOOL = 12,
       DT_BF16 = 27 };
#define FORMAT_ND 2
enum { MEMCPY_H2H = 0, MEMCPY_H2D = 1, MEMCPY_D2H = 2, MEMCPY_D2D = 3 };

typedef struct aclTensor {
    uint32_t magic;
    int64_t ndim;
    int64_t dims[MAXD];
    int dtype;
    int64_t strides[MAXD];
    int64_t offset;
    int format;
    int64_t sndim;
    int64_t sdims[MAXD];
    void *data;
} aclTensor;

enum { OP_FLOMS = 1, OP_FCELWMS, OP_FLCEG, OP_CEG, OP_SMSB, OP_SL1B, OP_EMB };

typedef struct aclOpExecutor {
    uint32_t magic;
    int op;
    aclTensor t[MAXT];
    int present[MAXT];
    double f[4];
    int64_t i[4];
    uint64_t u[4];
    int b;
    char s[16];
    uint64_t ws;
} aclOpExecutor;

typedef struct FakeStream {
    uint32_t magic;
    aclOpExecutor *pending[64];
    int npending;
} FakeStream;

/* The prototypes, from the ONE table the backend binds (fastgrad/backends/aclnn_prototypes.h,
 * found through -I): every definition below must agree with it or this file does not compile. */
#include "aclnn_prototypes.h"

/* ---------------------------------------------------------------- shared (exported by ACL) */
FAKE_API void fake_logf(const char *fmt, ...);
FAKE_API int fake_check_fail(const char *fn);
FAKE_API void fake_violation(const char *fmt, ...);
FAKE_API void fake_set_errmsg(const char *fmt, ...);
FAKE_API void fake_count(const char *name, int64_t delta);
FAKE_API int fake_device_range_ok(const void *p, uint64_t nbytes);
FAKE_API int fake_initialized(void);
FAKE_API int fake_stream_known(void *s);
FAKE_API uint64_t fake_workspace_size(void);

__attribute__((unused)) static int64_t numel(const aclTensor *t) {
    int64_t n = 1;
    for (int64_t d = 0; d < t->ndim; d++) n *= t->dims[d];
    return n;
}

__attribute__((unused)) static int64_t dtsize(int dt) {
    switch (dt) {
        case DT_FLOAT: case DT_INT32: case DT_UINT32: return 4;
        case DT_FLOAT16: case DT_INT16: case DT_UINT16: case DT_BF16: return 2;
        case DT_INT8: case DT_UINT8: case DT_BOOL: return 1;
        case DT_INT64: case DT_UINT64: case DT_DOUBLE: return 8;
        default: return 0;
    }
}

/* JSON numbers: %.17g, with NaN/Infinity spelled as Python's json module reads them. */
__attribute__((unused)) static void fmt_double(char *buf, size_t n, double v) {
    if (isnan(v)) snprintf(buf, n, "NaN");
    else if (isinf(v)) snprintf(buf, n, v > 0 ? "Infinity" : "-Infinity");
    else snprintf(buf, n, "%.17g", v);
}

#ifdef FAKE_PART_ACL
/* ============================================================== libascendcl.so ============ */
typedef struct { void *p; uint64_t n; } Alloc;

static struct {
    char *log; size_t len, cap;
    char *json; size_t json_cap;
    int init;                  /* aclInit called and not finalized */
    uint64_t refcount;         /* aclInit reference count (recent CANN's aclInitRefCount) */
    int device;                /* set device id or -1 */
    Alloc allocs[8192]; int nallocs;
    FakeStream *streams[16]; int nstreams;
    char fail_fn[128]; int fail_code; int fail_nth; int fail_seen;
    char sigint_fn[128]; int sigint_nth; int sigint_seen;
    char errmsg[1024];
    char violation[1024];
    uint64_t workspace;        /* what stage one returns */
    int workspace_set;
    struct { char name[32]; int64_t v; } counters[64]; int ncounters;
} S = { .device = -1 };

FAKE_API void fake_count(const char *name, int64_t delta) {
    for (int k = 0; k < S.ncounters; k++)
        if (strcmp(S.counters[k].name, name) == 0) { S.counters[k].v += delta; return; }
    if (S.ncounters < 64) {
        snprintf(S.counters[S.ncounters].name, 32, "%s", name);
        S.counters[S.ncounters++].v = delta;
    }
}

FAKE_API int64_t fake_counter(const char *name) {
    for (int k = 0; k < S.ncounters; k++)
        if (strcmp(S.counters[k].name, name) == 0) return S.counters[k].v;
    return 0;
}

FAKE_API void fake_logf(const char *fmt, ...) {
    char tmp[8192];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof tmp) n = sizeof tmp - 1;
    if (S.len + n + 2 > S.cap) {
        size_t cap = S.cap ? S.cap * 2 : 65536;
        while (cap < S.len + n + 2) cap *= 2;
        S.log = realloc(S.log, cap);
        S.cap = cap;
    }
    memcpy(S.log + S.len, tmp, n);
    S.len += n;
    S.log[S.len++] = ',';
    S.log[S.len] = 0;
}

/* The log so far as a JSON array of call records. */
FAKE_API const char *fake_log_json(void) {
    size_t need = S.len + 3;
    if (need > S.json_cap) { S.json = realloc(S.json, need); S.json_cap = need; }
    S.json[0] = '[';
    size_t body = S.len ? S.len - 1 : 0;   /* drop the trailing comma */
    if (body) memcpy(S.json + 1, S.log, body);
    S.json[1 + body] = ']';
    S.json[2 + body] = 0;
    return S.json;
}

FAKE_API void fake_clear_log(void) { S.len = 0; if (S.log) S.log[0] = 0; }

FAKE_API void fake_violation(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(S.violation, sizeof S.violation, fmt, ap);
    va_end(ap);
    snprintf(S.errmsg, sizeof S.errmsg, "fake runtime protocol violation: %s", S.violation);
    fake_count("violations", 1);
}

FAKE_API const char *fake_last_violation(void) { return S.violation; }

FAKE_API void fake_set_errmsg(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(S.errmsg, sizeof S.errmsg, fmt, ap);
    va_end(ap);
}

/* Make the nth next call of function `fn` fail with `code` (once).  fn=NULL clears. */
FAKE_API void fake_fail(const char *fn, int code, int nth) {
    if (!fn) { S.fail_fn[0] = 0; return; }
    snprintf(S.fail_fn, sizeof S.fail_fn, "%s", fn);
    S.fail_code = code;
    S.fail_nth = nth < 1 ? 1 : nth;
    S.fail_seen = 0;
}

/* Deliver SIGINT to the process (Ctrl-C while the call waits) during the nth next call of `fn`
 * (once): Python raises KeyboardInterrupt when the call returns.  fn=NULL clears. */
FAKE_API void fake_interrupt(const char *fn, int nth) {
    if (!fn) { S.sigint_fn[0] = 0; return; }
    snprintf(S.sigint_fn, sizeof S.sigint_fn, "%s", fn);
    S.sigint_nth = nth < 1 ? 1 : nth;
    S.sigint_seen = 0;
}

FAKE_API int fake_check_fail(const char *fn) {
    if (S.sigint_fn[0] && strcmp(S.sigint_fn, fn) == 0 && ++S.sigint_seen >= S.sigint_nth) {
        S.sigint_fn[0] = 0;
        fake_count("interrupts", 1);
        raise(SIGINT);
    }
    if (!S.fail_fn[0] || strcmp(S.fail_fn, fn) != 0) return 0;
    if (++S.fail_seen < S.fail_nth) return 0;
    int code = S.fail_code;
    S.fail_fn[0] = 0;
    fake_set_errmsg("EZ9999: fake runtime: injected failure in %s (code %d)", fn, code);
    fake_count("injected", 1);
    return code;
}

FAKE_API void fake_set_workspace(uint64_t n) { S.workspace = n; S.workspace_set = 1; }

FAKE_API uint64_t fake_workspace_size(void) {
    if (S.workspace_set) return S.workspace;
    const char *e = getenv("FAKE_ACL_WORKSPACE");
    return e ? strtoull(e, NULL, 10) : 4096;
}

FAKE_API int fake_initialized(void) { return S.init; }

FAKE_API int fake_stream_known(void *s) {
    for (int k = 0; k < S.nstreams; k++) if (S.streams[k] == s) return 1;
    return 0;
}

static int find_alloc(const void *p) {
    for (int k = 0; k < S.nallocs; k++) if (S.allocs[k].p == p) return k;
    return -1;
}

/* [p, p+nbytes) lies inside one live device allocation. */
FAKE_API int fake_device_range_ok(const void *p, uint64_t nbytes) {
    const char *c = (const char *)p;
    for (int k = 0; k < S.nallocs; k++) {
        const char *a = (const char *)S.allocs[k].p;
        if (c >= a && c + nbytes <= a + S.allocs[k].n) return 1;
    }
    return 0;
}

FAKE_API int64_t fake_live_allocations(void) { return S.nallocs; }

static void exit_summary(void) {
    const char *path = getenv("FAKE_ACL_EXIT_LOG");
    if (!path) return;
    FILE *f = fopen(path, "w");
    if (!f) return;
    fprintf(f, "{");
    for (int k = 0; k < S.ncounters; k++)
        fprintf(f, "%s\"%s\": %lld", k ? ", " : "", S.counters[k].name, (long long)S.counters[k].v);
    fprintf(f, "%s\"live_allocations\": %d, \"live_streams\": %d}\n", S.ncounters ? ", " : "",
            S.nallocs, S.nstreams);
    fclose(f);
}

#define REQUIRE_INIT(fn)                                                         \
    do {                                                                         \
        if (!S.init) { fake_violation("%s called before aclInit", fn);           \
                       fake_set_errmsg("%s: acl is not initialized", fn);        \
                       return 100000; }                                          \
    } while (0)

FAKE_API int aclInit(const char *configPath) {
    fake_logf("{\"fn\":\"aclInit\",\"config_null\":%d}", configPath == NULL);
    int f = fake_check_fail("aclInit");
    if (f) return f;
    /* recent CANN (acl.cpp aclInitImpl): a repeated aclInit takes a reference and still
     * returns ACL_ERROR_REPEAT_INITIALIZE */
    if (S.init) { S.refcount++; fake_count("init_repeat", 1); return 100002; }
    S.init = 1;
    S.refcount = 1;
    fake_count("init", 1);
    return 0;
}

FAKE_API int aclFinalize(void) {
    fake_logf("{\"fn\":\"aclFinalize\"}");
    if (!S.init) { fake_violation("aclFinalize without aclInit"); return 100037; }
    S.init = 0;
    S.refcount = 0;
    fake_count("finalize", 1);
    exit_summary();
    return 0;
}

/* acl.cpp aclFinalizeReferenceImpl: decrement; finalize for real at 1 -> 0 */
FAKE_API int aclFinalizeReference(uint64_t *refCount) {
    fake_logf("{\"fn\":\"aclFinalizeReference\",\"refcount\":%llu}", (unsigned long long)S.refcount);
    fake_count("finalize_reference", 1);
    if (S.refcount > 1) {
        S.refcount--;
        if (refCount) *refCount = S.refcount;
        return 0;
    }
    if (S.refcount < 1) { if (refCount) *refCount = 0; return 100037; /* ACL_ERROR_REPEAT_FINALIZE */ }
    S.refcount = 0;
    S.init = 0;
    if (refCount) *refCount = 0;
    fake_count("finalize", 1);
    exit_summary();
    return 0;
}

FAKE_API uint64_t fake_refcount(void) { return S.refcount; }

/* The CANN version: FAKE_ACL_VERSION (default 8.5.0); "none" -> ACL_ERROR_INVALID_FILE. */
FAKE_API int aclsysGetVersionStr(char *pkgName, char *versionStr) {
    const char *e = getenv("FAKE_ACL_VERSION");
    const char *v = e ? e : "8.5.0";
    fake_logf("{\"fn\":\"aclsysGetVersionStr\",\"pkg\":\"%s\"}", pkgName ? pkgName : "");
    if (strcmp(v, "none") == 0) return 148049;
    snprintf(versionStr, 128, "%s", v);
    return 0;
}

FAKE_API const char *aclGetRecentErrMsg(void) { return S.errmsg[0] ? S.errmsg : NULL; }

/* The SoC name: FAKE_ACL_SOC_NAME (default Ascend910B3, an Atlas A2); "none" -> NULL (failure).
 * Not logged: the backend asks once per runtime, before its first op. */
FAKE_API const char *aclrtGetSocName(void) {
    const char *e = getenv("FAKE_ACL_SOC_NAME");
    fake_count("get_soc_name", 1);
    if (e && strcmp(e, "none") == 0) return NULL;
    return e && e[0] ? e : "Ascend910B3";
}

FAKE_API int aclrtGetDeviceCount(uint32_t *count) {
    fake_logf("{\"fn\":\"aclrtGetDeviceCount\"}");
    fake_count("get_device_count", 1);
    int f = fake_check_fail("aclrtGetDeviceCount");
    if (f) return f;
    const char *e = getenv("FAKE_ACL_DEVICE_COUNT");
    *count = e ? (uint32_t)atoi(e) : 1u;
    return 0;
}

FAKE_API int aclrtSetDevice(int32_t deviceId) {
    fake_logf("{\"fn\":\"aclrtSetDevice\",\"device\":%d}", deviceId);
    REQUIRE_INIT("aclrtSetDevice");
    int f = fake_check_fail("aclrtSetDevice");
    if (f) return f;
    uint32_t n;
    const char *e = getenv("FAKE_ACL_DEVICE_COUNT");
    n = e ? (uint32_t)atoi(e) : 1u;
    if (deviceId < 0 || (uint32_t)deviceId >= n) {
        fake_set_errmsg("EE1001: invalid device id %d", deviceId);
        return 107001;
    }
    S.device = deviceId;
    fake_count("set_device", 1);
    return 0;
}

FAKE_API int aclrtResetDevice(int32_t deviceId) {
    fake_logf("{\"fn\":\"aclrtResetDevice\",\"device\":%d}", deviceId);
    REQUIRE_INIT("aclrtResetDevice");
    if (deviceId != S.device) fake_violation("aclrtResetDevice(%d) but device %d is set", deviceId, S.device);
    S.device = -1;
    fake_count("reset_device", 1);
    return 0;
}

static int ctx_token = 0x1234;

FAKE_API int aclrtGetCurrentContext(void **ctx) {
    fake_logf("{\"fn\":\"aclrtGetCurrentContext\"}");
    REQUIRE_INIT("aclrtGetCurrentContext");
    int f = fake_check_fail("aclrtGetCurrentContext");
    if (f) return f;
    if (S.device < 0) { fake_set_errmsg("no current context"); return 107002; }
    *ctx = &ctx_token;
    return 0;
}

FAKE_API int aclrtSetCurrentContext(void *ctx) {
    fake_logf("{\"fn\":\"aclrtSetCurrentContext\",\"ctx\":%llu}", (unsigned long long)(uintptr_t)ctx);
    REQUIRE_INIT("aclrtSetCurrentContext");
    if (ctx != &ctx_token) fake_violation("aclrtSetCurrentContext with an unknown context");
    fake_count("set_context", 1);
    return 0;
}

FAKE_API int aclrtCreateStream(void **stream) {
    REQUIRE_INIT("aclrtCreateStream");
    int f = fake_check_fail("aclrtCreateStream");
    if (f) { fake_logf("{\"fn\":\"aclrtCreateStream\",\"ret\":%d}", f); return f; }
    if (S.device < 0) fake_violation("aclrtCreateStream before aclrtSetDevice");
    FakeStream *s = calloc(1, sizeof *s);
    s->magic = STREAM_MAGIC;
    S.streams[S.nstreams++] = s;
    *stream = s;
    fake_count("stream_create", 1);
    fake_logf("{\"fn\":\"aclrtCreateStream\",\"stream\":%llu}", (unsigned long long)(uintptr_t)s);
    return 0;
}

FAKE_API int aclrtDestroyStream(void *stream) {
    fake_logf("{\"fn\":\"aclrtDestroyStream\",\"stream\":%llu}", (unsigned long long)(uintptr_t)stream);
    REQUIRE_INIT("aclrtDestroyStream");
    for (int k = 0; k < S.nstreams; k++) {
        if (S.streams[k] == stream) {
            if (S.streams[k]->npending) fake_violation("aclrtDestroyStream with pending work");
            free(S.streams[k]);
            S.streams[k] = S.streams[--S.nstreams];
            fake_count("stream_destroy", 1);
            return 0;
        }
    }
    fake_violation("aclrtDestroyStream of an unknown stream");
    return 107003;
}

typedef int (*run_fn_t)(aclOpExecutor *);
static run_fn_t runner = NULL;
FAKE_API void fake_register_runner(run_fn_t fn) { runner = fn; }

FAKE_API int fake_enqueue(void *stream, aclOpExecutor *e) {
    FakeStream *s = (FakeStream *)stream;
    if (s->npending >= 64) return 507000;
    s->pending[s->npending++] = e;
    return 0;
}

FAKE_API int aclrtSynchronizeStream(void *stream) {
    fake_logf("{\"fn\":\"aclrtSynchronizeStream\",\"stream\":%llu}", (unsigned long long)(uintptr_t)stream);
    REQUIRE_INIT("aclrtSynchronizeStream");
    if (!fake_stream_known(stream)) {
        fake_violation("aclrtSynchronizeStream of an unknown stream");
        return 107003;
    }
    fake_count("sync", 1);
    FakeStream *s = (FakeStream *)stream;
    int ret = 0;
    for (int k = 0; k < s->npending; k++) {
        aclOpExecutor *e = s->pending[k];
        int r = runner ? runner(e) : 0;
        if (r && !ret) ret = r;
        e->magic = 0;
        free(e);
        fake_count("executor_destroy", 1);
        fake_count("live_executor", -1);
    }
    s->npending = 0;
    int f = fake_check_fail("aclrtSynchronizeStream");
    if (f) return f;
    return ret;
}

FAKE_API int aclrtMalloc(void **devPtr, size_t size, int policy) {
    REQUIRE_INIT("aclrtMalloc");
    int f = fake_check_fail("aclrtMalloc");
    if (f) {
        fake_logf("{\"fn\":\"aclrtMalloc\",\"size\":%llu,\"policy\":%d,\"ret\":%d}",
                  (unsigned long long)size, policy, f);
        return f;
    }
    if (S.device < 0) fake_violation("aclrtMalloc before aclrtSetDevice");
    if (size == 0) { fake_violation("aclrtMalloc of 0 bytes"); fake_set_errmsg("size 0"); return 100000; }
    if (S.nallocs >= 8192) return 207001;
    void *p = malloc(size);
    memset(p, 0xAB, size); /* uninitialised device memory */
    S.allocs[S.nallocs].p = p;
    S.allocs[S.nallocs++].n = size;
    *devPtr = p;
    fake_count("malloc", 1);
    fake_count("malloc_bytes", (int64_t)size);
    fake_logf("{\"fn\":\"aclrtMalloc\",\"size\":%llu,\"policy\":%d,\"ptr\":%llu,\"ret\":0}",
              (unsigned long long)size, policy, (unsigned long long)(uintptr_t)p);
    return 0;
}

FAKE_API int aclrtFree(void *devPtr) {
    fake_logf("{\"fn\":\"aclrtFree\",\"ptr\":%llu}", (unsigned long long)(uintptr_t)devPtr);
    REQUIRE_INIT("aclrtFree");
    for (int q = 0; q < S.nstreams; q++)
        if (S.streams[q]->npending)
            fake_violation("aclrtFree while work is pending on a stream (acl_rt.h: synchronize first)");
    int k = find_alloc(devPtr);
    if (k < 0) {
        fake_violation("aclrtFree of an unknown or already freed pointer");
        return 107000;
    }
    free(S.allocs[k].p);
    S.allocs[k] = S.allocs[--S.nallocs];
    fake_count("free", 1);
    return fake_check_fail("aclrtFree"); /* an injected status is reported after the release */
}

FAKE_API int aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, int kind) {
    fake_logf("{\"fn\":\"aclrtMemcpy\",\"dst\":%llu,\"destMax\":%llu,\"src\":%llu,\"count\":%llu,\"kind\":%d}",
              (unsigned long long)(uintptr_t)dst, (unsigned long long)destMax,
              (unsigned long long)(uintptr_t)src, (unsigned long long)count, kind);
    REQUIRE_INIT("aclrtMemcpy");
    int f = fake_check_fail("aclrtMemcpy");
    if (f) return f;
    if (count > destMax) { fake_violation("aclrtMemcpy count %zu > destMax %zu", count, destMax); return 100000; }
    if (kind == MEMCPY_H2D) {
        if (!fake_device_range_ok(dst, count)) { fake_violation("aclrtMemcpy H2D: dst not device memory"); return 100000; }
        if (fake_device_range_ok(src, 1)) fake_violation("aclrtMemcpy H2D: src is device memory");
        fake_count("h2d", 1);
        fake_count("h2d_bytes", (int64_t)count);
    } else if (kind == MEMCPY_D2H) {
        if (!fake_device_range_ok(src, count)) { fake_violation("aclrtMemcpy D2H: src not device memory"); return 100000; }
        if (fake_device_range_ok(dst, 1)) fake_violation("aclrtMemcpy D2H: dst is device memory");
        fake_count("d2h", 1);
        fake_count("d2h_bytes", (int64_t)count);
    } else {
        fake_violation("aclrtMemcpy kind %d not expected", kind);
        return 100000;
    }
    memcpy(dst, src, count);
    return 0;
}

#endif /* FAKE_PART_ACL */

#ifdef FAKE_PART_NNOPBASE
/* ============================================================== libnnopbase.so =========== */
/* Byte range [lo, hi) of a view, relative to data. */
static void view_range(const aclTensor *t, int64_t *lo, int64_t *hi) {
    int64_t mn = t->offset, mx = t->offset;
    for (int64_t d = 0; d < t->ndim; d++) {
        if (t->dims[d] <= 0) { *lo = *hi = 0; return; }
        int64_t ext = (t->dims[d] - 1) * t->strides[d];
        if (ext < 0) mn += ext; else mx += ext;
    }
    *lo = mn * dtsize(t->dtype);
    *hi = (mx + 1) * dtsize(t->dtype);
}

FAKE_API aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, int dataType,
                                    const int64_t *stride, int64_t offset, int format,
                                    const int64_t *storageDims, uint64_t storageDimsNum, void *tensorData) {
    char dims[512] = "", strides[512] = "", sdims[512] = "";
    size_t a = 0, b = 0, c = 0;
    for (uint64_t d = 0; d < viewDimsNum && d < MAXD; d++) {
        a += snprintf(dims + a, sizeof dims - a, "%s%lld", d ? "," : "", (long long)viewDims[d]);
        b += snprintf(strides + b, sizeof strides - b, "%s%lld", d ? "," : "", (long long)stride[d]);
    }
    for (uint64_t d = 0; d < storageDimsNum && d < MAXD; d++)
        c += snprintf(sdims + c, sizeof sdims - c, "%s%lld", d ? "," : "", (long long)storageDims[d]);
    int f = fake_check_fail("aclCreateTensor");
    if (!fake_initialized()) fake_violation("aclCreateTensor before aclInit");
    aclTensor *t = NULL;
    if (!f && viewDimsNum <= MAXD && storageDimsNum <= MAXD && dtsize(dataType) && format == FORMAT_ND) {
        t = calloc(1, sizeof *t);
        t->magic = TENSOR_MAGIC;
        t->ndim = (int64_t)viewDimsNum;
        for (uint64_t d = 0; d < viewDimsNum; d++) { t->dims[d] = viewDims[d]; t->strides[d] = stride[d]; }
        t->dtype = dataType;
        t->offset = offset;
        t->format = format;
        t->sndim = (int64_t)storageDimsNum;
        int64_t selems = 1;
        for (uint64_t d = 0; d < storageDimsNum; d++) { t->sdims[d] = storageDims[d]; selems *= storageDims[d]; }
        t->data = tensorData;
        if (numel(t) > 0) {
            int64_t lo, hi;
            view_range(t, &lo, &hi);
            if (lo < 0 || hi > selems * dtsize(dataType))
                fake_violation("aclCreateTensor: view [%lld, %lld) bytes outside storage of %lld elements",
                               (long long)lo, (long long)hi, (long long)selems);
            if (!fake_device_range_ok((char *)tensorData + lo, (uint64_t)(hi - lo)))
                fake_violation("aclCreateTensor: view not inside one device allocation");
        }
        fake_count("tensor_create", 1);
        fake_count("live_tensor", 1);
    } else if (!f) {
        fake_violation("aclCreateTensor: bad arguments (ndim %llu, dtype %d, format %d)",
                       (unsigned long long)viewDimsNum, dataType, format);
        fake_set_errmsg("aclCreateTensor: bad arguments");
    }
    fake_logf("{\"fn\":\"aclCreateTensor\",\"dims\":[%s],\"ndim\":%llu,\"dtype\":%d,\"strides\":[%s],"
              "\"offset\":%lld,\"format\":%d,\"storage\":[%s],\"sndim\":%llu,\"data\":%llu,\"ret\":%llu}",
              dims, (unsigned long long)viewDimsNum, dataType, strides, (long long)offset, format, sdims,
              (unsigned long long)storageDimsNum, (unsigned long long)(uintptr_t)tensorData,
              (unsigned long long)(uintptr_t)t);
    return t;
}

FAKE_API int aclDestroyTensor(const aclTensor *tensor) {
    fake_logf("{\"fn\":\"aclDestroyTensor\",\"tensor\":%llu}", (unsigned long long)(uintptr_t)tensor);
    if (!tensor || tensor->magic != TENSOR_MAGIC) {
        fake_violation("aclDestroyTensor of an unknown or destroyed tensor");
        return 161002;
    }
    ((aclTensor *)tensor)->magic = 0;
    free((void *)tensor);
    fake_count("tensor_destroy", 1);
    fake_count("live_tensor", -1);
    return 0;
}

FAKE_API int aclDestroyAclOpExecutor(aclOpExecutor *executor) {
    fake_logf("{\"fn\":\"aclDestroyAclOpExecutor\",\"executor\":%llu}", (unsigned long long)(uintptr_t)executor);
    if (!executor || executor->magic != EXEC_MAGIC) {
        fake_violation("aclDestroyAclOpExecutor of an unknown executor");
        return 161002;
    }
    executor->magic = 0;
    free(executor);
    fake_count("executor_destroy", 1);
    fake_count("live_executor", -1);
    return 0;
}
#endif /* FAKE_PART_NNOPBASE */

#ifdef FAKE_PART_OPAPI
/* ============================================================== libopapi.so ============== */
FAKE_API int fake_enqueue(void *stream, aclOpExecutor *e);
FAKE_API void fake_register_runner(int (*fn)(aclOpExecutor *));

/* --- 16-bit formats --- */
static float bf2f(uint16_t h) { uint32_t x = (uint32_t)h << 16; float f; memcpy(&f, &x, 4); return f; }
static uint16_t f2bf(float f) {
    uint32_t x; memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
static float h2f(uint16_t h) {
    uint32_t s = (h >> 15) & 1u, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    float v;
    if (e == 0) v = ldexpf((float)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = ldexpf((float)(m | 0x400u), (int)e - 25);
    return s ? -v : v;
}
static uint16_t f2h(float f) {
    uint32_t x; memcpy(&x, &f, 4);
    uint16_t s = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return s | 0x7e00u;
    if (x >= 0x477ff000u) return s | 0x7c00u;      /* >= 65520 rounds to inf */
    if (x < 0x38800000u) {                           /* below 2^-14: subnormal half */
        float a; memcpy(&a, &x, 4);
        return s | (uint16_t)nearbyintf(a * 16777216.0f);
    }
    uint32_t h = (((x >> 23) - 112u) << 10) | ((x & 0x7fffffu) >> 13);
    uint32_t rem = x & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return s | (uint16_t)h;
}

static double round_to(int dt, double v) {
    float f = (float)v;
    if (dt == DT_BF16) return bf2f(f2bf(f));
    if (dt == DT_FLOAT16) return h2f(f2h(f));
    if (dt == DT_FLOAT) return f;
    return v;
}

/* element offset (in elements) of C-order flat index `flat` of the view */
static int64_t elem_off(const aclTensor *t, int64_t flat) {
    int64_t off = t->offset;
    for (int64_t d = t->ndim - 1; d >= 0; d--) {
        int64_t n = t->dims[d];
        off += (flat % n) * t->strides[d];
        flat /= n;
    }
    return off;
}

static double rd(const aclTensor *t, int64_t off) {
    const char *p = (const char *)t->data + off * dtsize(t->dtype);
    switch (t->dtype) {
        case DT_FLOAT: { float v; memcpy(&v, p, 4); return v; }
        case DT_FLOAT16: { uint16_t v; memcpy(&v, p, 2); return h2f(v); }
        case DT_BF16: { uint16_t v; memcpy(&v, p, 2); return bf2f(v); }
        case DT_DOUBLE: { double v; memcpy(&v, p, 8); return v; }
        case DT_INT8: return *(const int8_t *)p;
        case DT_UINT8: return *(const uint8_t *)p;
        case DT_BOOL: return *(const uint8_t *)p != 0;
        case DT_INT16: { int16_t v; memcpy(&v, p, 2); return v; }
        case DT_INT32: { int32_t v; memcpy(&v, p, 4); return v; }
        case DT_INT64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
        default: return NAN;
    }
}

static double getf(const aclTensor *t, int64_t flat) { return rd(t, elem_off(t, flat)); }

static void setf(const aclTensor *t, int64_t flat, double v) {
    char *p = (char *)t->data + elem_off(t, flat) * dtsize(t->dtype);
    switch (t->dtype) {
        case DT_FLOAT: { float f = (float)v; memcpy(p, &f, 4); break; }
        case DT_FLOAT16: { uint16_t h = f2h((float)v); memcpy(p, &h, 2); break; }
        case DT_BF16: { uint16_t h = f2bf((float)v); memcpy(p, &h, 2); break; }
        case DT_DOUBLE: memcpy(p, &v, 8); break;
        case DT_UINT8: case DT_BOOL: *(uint8_t *)p = (uint8_t)(int64_t)v; break;
        case DT_INT8: *(int8_t *)p = (int8_t)(int64_t)v; break;
        case DT_INT32: { int32_t i = (int32_t)(int64_t)v; memcpy(p, &i, 4); break; }
        case DT_INT64: { int64_t i = (int64_t)v; memcpy(p, &i, 8); break; }
        default: break;
    }
}

/* element of `t` broadcast against `o`'s shape, at o's flat index */
static double getb(const aclTensor *t, const aclTensor *o, int64_t flat) {
    int64_t off = t->offset;
    for (int64_t d = o->ndim - 1, e = t->ndim - 1; d >= 0; d--, e--) {
        int64_t idx = flat % o->dims[d];
        flat /= o->dims[d];
        if (e >= 0 && t->dims[e] != 1) off += idx * t->strides[e];
    }
    return rd(t, off);
}

static int data_ok(const aclTensor *t) {
    if (numel(t) == 0) return 1;
    int64_t mn = t->offset, mx = t->offset;
    for (int64_t d = 0; d < t->ndim; d++) {
        int64_t ext = (t->dims[d] - 1) * t->strides[d];
        if (ext < 0) mn += ext; else mx += ext;
    }
    int64_t sz = dtsize(t->dtype);
    return fake_device_range_ok((const char *)t->data + mn * sz, (uint64_t)((mx - mn + 1) * sz));
}

/* --- logging of tensor arguments --- */
static const char *tp(const aclTensor *t, char *buf) {
    snprintf(buf, 32, "%llu", (unsigned long long)(uintptr_t)t);
    return buf;
}

static aclOpExecutor *new_exec(int op, const aclTensor *const *ts, int n) {
    aclOpExecutor *e = calloc(1, sizeof *e);
    e->magic = EXEC_MAGIC;
    e->op = op;
    for (int k = 0; k < n; k++) {
        if (ts[k]) {
            if (ts[k]->magic != TENSOR_MAGIC) fake_violation("op %d: tensor argument %d is not a live aclTensor", op, k);
            e->t[k] = *ts[k];
            e->present[k] = 1;
        }
    }
    e->ws = fake_workspace_size();
    fake_count("executor_create", 1);
    fake_count("live_executor", 1);
    return e;
}

static int stage_one_common(const char *fn, uint64_t *workspaceSize, void **executor) {
    if (!workspaceSize || !executor) { fake_violation("%s: null workspaceSize/executor pointer", fn); return 161001; }
    if (!fake_initialized()) fake_violation("%s before aclInit", fn);
    return fake_check_fail(fn);
}

static int null_arg(const char *fn, const char *name) {
    fake_set_errmsg("%s: %s must not be nullptr", fn, name);
    return 161001;
}

/* --- stage two (shared by every op) --- */
static int stage_two(const char *fn, void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, void *stream) {
    fake_logf("{\"fn\":\"%s\",\"workspace\":%llu,\"workspaceSize\":%llu,\"executor\":%llu,\"stream\":%llu}",
              fn, (unsigned long long)(uintptr_t)workspace, (unsigned long long)workspaceSize,
              (unsigned long long)(uintptr_t)executor, (unsigned long long)(uintptr_t)stream);
    if (!executor || executor->magic != EXEC_MAGIC) {
        fake_violation("%s: unknown executor", fn);
        return 161002;
    }
    if (workspaceSize != executor->ws)
        fake_violation("%s: workspaceSize %llu differs from stage one's %llu", fn,
                       (unsigned long long)workspaceSize, (unsigned long long)executor->ws);
    if (workspaceSize > 0 && !fake_device_range_ok(workspace, workspaceSize))
        fake_violation("%s: workspace is not a device allocation of %llu bytes", fn, (unsigned long long)workspaceSize);
    if (!fake_stream_known(stream)) {
        fake_violation("%s: unknown stream", fn);
        return 161002;
    }
    int f = fake_check_fail(fn);
    if (f) {  /* the executor is consumed even on failure; the launch may already be queued (an
                 asynchronous error), so it stays pending -- computing nothing -- until a sync */
        executor->op = 0;
        fake_enqueue(stream, executor);
        return f;
    }
    if (workspaceSize > 0) memset(workspace, 0x5A, workspaceSize); /* the op uses its workspace */
    return fake_enqueue(stream, executor);
}

/* ---------------------------------------------------------- the seven ops' computations */
static int run_floms(aclOpExecutor *e) {
    const aclTensor *x = &e->t[0], *w = &e->t[1], *tg = &e->t[2], *lmax = &e->t[3], *sum = &e->t[4],
                    *pred = &e->t[5], *mask = &e->t[6], *mt = &e->t[7], *vpl = e->present[8] ? &e->t[8] : NULL;
    int64_t BT = x->dims[0], H = x->dims[1], V = w->dims[0], start = e->i[0], end = e->i[1];
    double *row = malloc(sizeof(double) * (V ? V : 1));
    unsigned char *bits = calloc((size_t)(BT + 8), 1);
    for (int64_t r = 0; r < BT; r++) {
        double mx = -INFINITY;
        for (int64_t v = 0; v < V; v++) {
            double acc = 0;
            for (int64_t h = 0; h < H; h++) acc += getf(x, r * H + h) * getf(w, v * H + h);
            row[v] = round_to(x->dtype, acc);
            if (vpl) setf(vpl, r * V + v, row[v]);
            if (row[v] > mx) mx = row[v];
        }
        double s = 0;
        for (int64_t v = 0; v < V; v++) s += exp(row[v] - mx);
        int64_t t = (int64_t)getf(tg, r);
        int masked = t < start || t >= end;
        int64_t m = masked ? 0 : t - start;
        bits[r] = (unsigned char)masked;
        setf(lmax, r, mx);
        setf(sum, r, s);
        setf(pred, r, masked || m >= V ? 0.0 : row[m] - mx);
        setf(mt, r, (double)m);
    }
    for (int64_t k = 0; k < numel(mask); k++) {
        int byte = 0;
        for (int b = 0; b < 8; b++) {
            int64_t p = k * 8 + b;
            byte |= (p < BT ? bits[p] : 1) << b;
        }
        setf(mask, k, byte);
    }
    free(row);
    free(bits);
    return 0;
}

static int run_fcelwms(aclOpExecutor *e) {
    const aclTensor *lmax = &e->t[0], *sum = &e->t[1], *pred = &e->t[2], *vpl = e->present[5] ? &e->t[5] : NULL,
                    *loss = &e->t[6], *sm = e->present[7] ? &e->t[7] : NULL;
    int64_t BT = numel(lmax);
    for (int64_t r = 0; r < BT; r++) setf(loss, r, log(getf(sum, r)) - getf(pred, r));
    if (vpl && sm) {
        int64_t V = vpl->dims[1];
        for (int64_t r = 0; r < BT; r++)
            for (int64_t v = 0; v < V; v++)
                setf(sm, r * V + v, exp(getf(vpl, r * V + v) - getf(lmax, r)) / getf(sum, r));
    }
    return 0;
}

static int run_flceg(aclOpExecutor *e) {
    const aclTensor *g = &e->t[0], *x = &e->t[1], *w = &e->t[2], *tm = &e->t[3], *mt = &e->t[4],
                    *lmax = e->present[5] ? &e->t[5] : NULL, *sum = e->present[6] ? &e->t[6] : NULL,
                    *sm = e->present[7] ? &e->t[7] : NULL, *gin = &e->t[8], *gw = &e->t[9];
    int64_t BT = x->dims[0], H = x->dims[1], V = w->dims[0];
    if (BT == 0 || V == 0 || H == 0) return 0; /* empty: outputs untouched */
    double *G = malloc(sizeof(double) * BT * V);
    for (int64_t r = 0; r < BT; r++) {
        int masked = tm->dtype == DT_BOOL ? getf(tm, r) != 0 : (((int64_t)getf(tm, r >> 3) >> (r & 7)) & 1);
        int64_t t = (int64_t)getf(mt, r);
        for (int64_t v = 0; v < V; v++) {
            double p;
            if (sm) p = getf(sm, r * V + v);
            else {
                double acc = 0;
                for (int64_t h = 0; h < H; h++) acc += getf(x, r * H + h) * getf(w, v * H + h);
                p = exp((double)(float)acc - getf(lmax, r)) / getf(sum, r);
            }
            if (!masked && v == t) p -= 1.0;
            G[r * V + v] = round_to(x->dtype, p * getf(g, r));
        }
    }
    for (int64_t r = 0; r < BT; r++)
        for (int64_t h = 0; h < H; h++) {
            double acc = 0;
            for (int64_t v = 0; v < V; v++) acc += G[r * V + v] * getf(w, v * H + h);
            setf(gin, r * H + h, acc);
        }
    for (int64_t v = 0; v < V; v++)
        for (int64_t h = 0; h < H; h++) {
            double acc = 0;
            for (int64_t r = 0; r < BT; r++) acc += G[r * V + v] * getf(x, r * H + h);
            setf(gw, v * H + h, acc);
        }
    free(G);
    return 0;
}

static int run_ceg(aclOpExecutor *e) {
    const aclTensor *gl = &e->t[0], *lp = &e->t[1], *tg = &e->t[2], *wt = e->present[3] ? &e->t[3] : NULL,
                    *xg = &e->t[6];
    int64_t N = lp->dims[0], C = lp->dims[1], ignore = e->i[0];
    double ls = e->f[0];
    const char *red = e->s;
    double W = 0, wsum = 0;
    for (int64_t c = 0; c < C; c++) wsum += wt ? getf(wt, c) : 1.0;
    for (int64_t i = 0; i < N; i++) {
        int64_t t = (int64_t)getf(tg, i);
        if (t != ignore) W += wt ? getf(wt, t) : 1.0;
    }
    for (int64_t i = 0; i < N; i++) {
        int64_t t = (int64_t)getf(tg, i);
        double s = strcmp(red, "none") == 0 ? getf(gl, i) : getf(gl, 0);
        if (strcmp(red, "mean") == 0) s /= W;
        double wi = t == ignore ? 0.0 : (wt ? getf(wt, t) : 1.0);
        for (int64_t j = 0; j < C; j++) {
            double v = 0;
            if (t != ignore) {
                double p = exp(getf(lp, i * C + j)), wj = wt ? getf(wt, j) : 1.0;
                v = s * ((1 - ls) * wi * (p - (j == t)) + (ls / C) * (p * wsum - wj));
            }
            setf(xg, i * C + j, v);
        }
    }
    return 0;
}

static int run_smsb(aclOpExecutor *e) {
    const aclTensor *gy = &e->t[0], *y = &e->t[1], *mask = e->present[2] ? &e->t[2] : NULL, *out = &e->t[3];
    double scale = e->f[0];
    int fix = e->b;
    int64_t S2 = out->dims[out->ndim - 1], S1 = out->ndim >= 2 ? out->dims[out->ndim - 2] : 1;
    int64_t rows = S2 ? numel(out) / S2 : 0;
    for (int64_t r = 0; r < rows; r++) {
        double s = 0;
        for (int64_t j = 0; j < S2; j++) s += getf(gy, r * S2 + j) * getf(y, r * S2 + j);
        for (int64_t j = 0; j < S2; j++) {
            int64_t k = r * S2 + j;
            double v = (getf(gy, k) * getf(y, k) - s * getf(y, k)) * scale;
            if ((mask && getb(mask, out, k) != 0) || (fix && j > r % S1)) v = 0;
            setf(out, k, v);
        }
    }
    return 0;
}

static int run_sl1b(aclOpExecutor *e) {
    const aclTensor *g = &e->t[0], *x = &e->t[1], *t = &e->t[2], *out = &e->t[3];
    int64_t n = numel(out), red = e->i[0];
    double beta = e->f[0];
    for (int64_t k = 0; k < n; k++) {
        double d = getb(x, out, k) - getb(t, out, k), v;
        if (beta > 0 && fabs(d) < beta) v = d / beta;
        else v = d > 0 ? 1.0 : (d < 0 ? -1.0 : (d == 0 ? 0.0 : d));
        v *= getb(g, out, k);
        if (red == 1) v /= (double)n;
        setf(out, k, v);
    }
    return 0;
}

static int run_emb(aclOpExecutor *e) {
    const aclTensor *g = &e->t[0], *idx = &e->t[1], *out = &e->t[2];
    int64_t n = numel(idx), K = (int64_t)e->u[0], pad = (int64_t)e->u[1];
    int64_t D = out->dims[1];
    double *acc = calloc((size_t)(K * D + 1), sizeof(double));
    double *cnt = calloc((size_t)(K + 1), sizeof(double));
    for (int64_t i = 0; i < n; i++) {
        int64_t k = (int64_t)getf(idx, i);
        if (k < 0 || k >= K) { free(acc); free(cnt); fake_set_errmsg("index %lld out of range", (long long)k); return 507015; }
        cnt[k] += 1;
        if (k == pad) continue;
        for (int64_t d = 0; d < D; d++) acc[k * D + d] += getf(g, i * D + d);
    }
    for (int64_t k = 0; k < K; k++)
        for (int64_t d = 0; d < D; d++)
            setf(out, k * D + d, e->b && cnt[k] > 0 ? acc[k * D + d] / cnt[k] : acc[k * D + d]);
    free(acc);
    free(cnt);
    return 0;
}

static int runner(aclOpExecutor *e) {
    for (int k = 0; k < MAXT; k++)
        if (e->present[k] && !data_ok(&e->t[k])) {
            fake_violation("op %d: tensor %d's data is not (or no longer) device memory at execution", e->op, k);
            fake_set_errmsg("EZ9999: device memory fault");
            return 507035;
        }
    switch (e->op) {
        case OP_FLOMS: return run_floms(e);
        case OP_FCELWMS: return run_fcelwms(e);
        case OP_FLCEG: return run_flceg(e);
        case OP_CEG: return run_ceg(e);
        case OP_SMSB: return run_smsb(e);
        case OP_SL1B: return run_sl1b(e);
        case OP_EMB: return run_emb(e);
    }
    return 0;
}

__attribute__((constructor)) static void register_runner(void) { fake_register_runner(runner); }

/* ---------------------------------------------------------- the aclnn entry points */
#define T(x) tp(x, b##x)
#define B(x) char b##x[32]

FAKE_API int aclnnFusedLinearOnlineMaxSumGetWorkspaceSize(
    const aclTensor *input, const aclTensor *weight, const aclTensor *target, int64_t vocabStartIndex,
    int64_t vocabEndIndex, aclTensor *logitsMaxLocalOut, aclTensor *sumExpLogitsLocalOut,
    aclTensor *predictedLogitsLocalOut, aclTensor *targetMaskOut, aclTensor *maskedTargetOut,
    aclTensor *vocabParallelLogitsOutOptional, uint64_t *workspaceSize, aclOpExecutor **executor) {
    const char *fn = "aclnnFusedLinearOnlineMaxSumGetWorkspaceSize";
    B(input); B(weight); B(target); B(logitsMaxLocalOut); B(sumExpLogitsLocalOut); B(predictedLogitsLocalOut);
    B(targetMaskOut); B(maskedTargetOut); B(vocabParallelLogitsOutOptional);
    int ret = stage_one_common(fn, workspaceSize, (void **)executor);
    if (!ret && (!input || !weight || !target || !logitsMaxLocalOut || !sumExpLogitsLocalOut ||
                 !predictedLogitsLocalOut || !targetMaskOut || !maskedTargetOut))
        ret = null_arg(fn, "a required tensor");
    if (!ret && vocabStartIndex < 0) { fake_set_errmsg("%s: vocabStartIndex must be >= 0", fn); ret = 161002; }
    if (!ret && vocabEndIndex < vocabStartIndex) { fake_set_errmsg("%s: vocabEndIndex < vocabStartIndex", fn); ret = 161002; }
    aclOpExecutor *e = NULL;
    if (!ret) {
        const aclTensor *ts[] = {input, weight, target, logitsMaxLocalOut, sumExpLogitsLocalOut,
                                 predictedLogitsLocalOut, targetMaskOut, maskedTargetOut,
                                 vocabParallelLogitsOutOptional};
        e = new_exec(OP_FLOMS, ts, 9);
        e->i[0] = vocabStartIndex;
        e->i[1] = vocabEndIndex;
        *workspaceSize = e->ws;
        *executor = e;
    }
    fake_logf("{\"fn\":\"%s\",\"tensors\":{\"input\":%s,\"weight\":%s,\"target\":%s,\"logitsMaxLocalOut\":%s,"
              "\"sumExpLogitsLocalOut\":%s,\"predictedLogitsLocalOut\":%s,\"targetMaskOut\":%s,"
              "\"maskedTargetOut\":%s,\"vocabParallelLogitsOutOptional\":%s},"
              "\"attrs\":{\"vocabStartIndex\":%lld,\"vocabEndIndex\":%lld},\"workspaceSize\":%llu,"
              "\"executor\":%llu,\"ret\":%d}",
              fn, T(input), T(weight), T(target), T(logitsMaxLocalOut), T(sumExpLogitsLocalOut),
              T(predictedLogitsLocalOut), T(targetMaskOut), T(maskedTargetOut), T(vocabParallelLogitsOutOptional),
              (long long)vocabStartIndex, (long long)vocabEndIndex, (unsigned long long)(e ? e->ws : 0),
              (unsigned long long)(uintptr_t)e, ret);
    return ret;
}

FAKE_API int aclnnFusedLinearOnlineMaxSum(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, void *stream) {
    return stage_two("aclnnFusedLinearOnlineMaxSum", workspace, workspaceSize, executor, stream);
}

FAKE_API int aclnnFusedCrossEntropyLossWithMaxSumGetWorkspaceSize(
    const aclTensor *logitsMax, const aclTensor *sumExpLogits, const aclTensor *predictedLogits, float labelSmoothing,
    const aclTensor *inputOptional, const aclTensor *weightOptional, const aclTensor *vocabParallelLogitsOptional,
    aclTensor *lossOut, aclTensor *softMaxOutOptional, uint64_t *workspaceSize, aclOpExecutor **executor) {
    const char *fn = "aclnnFusedCrossEntropyLossWithMaxSumGetWorkspaceSize";
    B(logitsMax); B(sumExpLogits); B(predictedLogits); B(inputOptional); B(weightOptional);
    B(vocabParallelLogitsOptional); B(lossOut); B(softMaxOutOptional);
    char ls[40];
    fmt_double(ls, sizeof ls, labelSmoothing);
    int ret = stage_one_common(fn, workspaceSize, (void **)executor);
    if (!ret && (!logitsMax || !sumExpLogits || !predictedLogits || !lossOut)) ret = null_arg(fn, "a required tensor");
    if (!ret && labelSmoothing != 0.0f) { fake_set_errmsg("%s: labelSmoothing only supports 0", fn); ret = 161002; }
    aclOpExecutor *e = NULL;
    if (!ret) {
        const aclTensor *ts[] = {logitsMax, sumExpLogits, predictedLogits, inputOptional, weightOptional,
                                 vocabParallelLogitsOptional, lossOut, softMaxOutOptional};
        e = new_exec(OP_FCELWMS, ts, 8);
        e->f[0] = labelSmoothing;
        *workspaceSize = e->ws;
        *executor = e;
    }
    fake_logf("{\"fn\":\"%s\",\"tensors\":{\"logitsMax\":%s,\"sumExpLogits\":%s,\"predictedLogits\":%s,"
              "\"inputOptional\":%s,\"weightOptional\":%s,\"vocabParallelLogitsOptional\":%s,\"lossOut\":%s,"
              "\"softMaxOutOptional\":%s},\"attrs\":{\"labelSmoothing\":%s},\"workspaceSize\":%llu,"
              "\"executor\":%llu,\"ret\":%d}",
              fn, T(logitsMax), T(sumExpLogits), T(predictedLogits), T(inputOptional), T(weightOptional),
              T(vocabParallelLogitsOptional), T(lossOut), T(softMaxOutOptional), ls,
              (unsigned long long)(e ? e->ws : 0), (unsigned long long)(uintptr_t)e, ret);
    return ret;
}

FAKE_API int aclnnFusedCrossEntropyLossWithMaxSum(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, void *stream) {
    return stage_two("aclnnFusedCrossEntropyLossWithMaxSum", workspace, workspaceSize, executor, stream);
}

FAKE_API int aclnnFusedLinearCrossEntropyLossGradGetWorkspaceSize(
    const aclTensor *grad, const aclTensor *input, const aclTensor *weight, const aclTensor *targetMask,
    const aclTensor *maskedTarget, float labelSmoothing, const aclTensor *logitsMaxOptional,
    const aclTensor *sumExpLogitsOptional, const aclTensor *softmaxOptional, aclTensor *inputGradOut,
    aclTensor *weightGradOut, uint64_t *workspaceSize, aclOpExecutor **executor) {
    const char *fn = "aclnnFusedLinearCrossEntropyLossGradGetWorkspaceSize";
    B(grad); B(input); B(weight); B(targetMask); B(maskedTarget); B(logitsMaxOptional); B(sumExpLogitsOptional);
    B(softmaxOptional); B(inputGradOut); B(weightGradOut);
    char ls[40];
    fmt_double(ls, sizeof ls, labelSmoothing);
    int ret = stage_one_common(fn, workspaceSize, (void **)executor);
    if (!ret && (!grad || !input || !weight || !targetMask || !maskedTarget || !inputGradOut || !weightGradOut))
        ret = null_arg(fn, "a required tensor");
    if (!ret && !softmaxOptional && (!logitsMaxOptional || !sumExpLogitsOptional))
        ret = null_arg(fn, "logitsMaxOptional/sumExpLogitsOptional (softmaxOptional is nullptr)");
    if (!ret && labelSmoothing != 0.0f) { fake_set_errmsg("%s: labelSmoothing only supports 0", fn); ret = 161002; }
    aclOpExecutor *e = NULL;
    if (!ret) {
        const aclTensor *ts[] = {grad, input, weight, targetMask, maskedTarget, logitsMaxOptional,
                                 sumExpLogitsOptional, softmaxOptional, inputGradOut, weightGradOut};
        e = new_exec(OP_FLCEG, ts, 10);
        e->f[0] = labelSmoothing;
        *workspaceSize = e->ws;
        *executor = e;
    }
    fake_logf("{\"fn\":\"%s\",\"tensors\":{\"grad\":%s,\"input\":%s,\"weight\":%s,\"targetMask\":%s,"
              "\"maskedTarget\":%s,\"logitsMaxOptional\":%s,\"sumExpLogitsOptional\":%s,\"softmaxOptional\":%s,"
              "\"inputGradOut\":%s,\"weightGradOut\":%s},\"attrs\":{\"labelSmoothing\":%s},"
              "\"workspaceSize\":%llu,\"executor\":%llu,\"ret\":%d}",
              fn, T(grad), T(input), T(weight), T(targetMask), T(maskedTarget), T(logitsMaxOptional),
              T(sumExpLogitsOptional), T(softmaxOptional), T(inputGradOut), T(weightGradOut), ls,
              (unsigned long long)(e ? e->ws : 0), (unsigned long long)(uintptr_t)e, ret);
    return ret;
}

FAKE_API int aclnnFusedLinearCrossEntropyLossGrad(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, void *stream) {
    return stage_two("aclnnFusedLinearCrossEntropyLossGrad", workspace, workspaceSize, executor, stream);
}

FAKE_API int aclnnCrossEntropyLossGradGetWorkspaceSize(
    const aclTensor *gradLoss, const aclTensor *logProb, const aclTensor *target, const aclTensor *weightOptional,
    const aclTensor *gradZlossOptional, const aclTensor *lseForZlossOptional, char *reduction,
    int64_t ignoreIndex, double labelSmoothing, double lseSquareScaleForZloss, const aclTensor *xGradOut,
    uint64_t *workspaceSize, aclOpExecutor **executor) {
    const char *fn = "aclnnCrossEntropyLossGradGetWorkspaceSize";
    B(gradLoss); B(logProb); B(target); B(weightOptional); B(gradZlossOptional); B(lseForZlossOptional); B(xGradOut);
    char ls[40], zs[40], red[40];
    fmt_double(ls, sizeof ls, labelSmoothing);
    fmt_double(zs, sizeof zs, lseSquareScaleForZloss);
    int ret = stage_one_common(fn, workspaceSize, (void **)executor);
    if (reduction == NULL) snprintf(red, sizeof red, "null");
    else if (strcmp(reduction, "none") == 0 || strcmp(reduction, "mean") == 0 || strcmp(reduction, "sum") == 0)
        snprintf(red, sizeof red, "\"%s\"", reduction);
    else snprintf(red, sizeof red, "\"<invalid>\"");
    if (!ret && (!gradLoss || !logProb || !target || !xGradOut)) ret = null_arg(fn, "a required tensor");
    if (!ret && red[0] != '"') { fake_set_errmsg("%s: reduction is nullptr", fn); ret = 161001; }
    if (!ret && strcmp(red, "\"<invalid>\"") == 0) { fake_set_errmsg("%s: bad reduction", fn); ret = 161002; }
    aclOpExecutor *e = NULL;
    if (!ret) {
        const aclTensor *ts[] = {gradLoss, logProb, target, weightOptional, gradZlossOptional, lseForZlossOptional,
                                 xGradOut};
        e = new_exec(OP_CEG, ts, 7);
        snprintf(e->s, sizeof e->s, "%s", reduction);
        e->i[0] = ignoreIndex;
        e->f[0] = labelSmoothing;
        e->f[1] = lseSquareScaleForZloss;
        *workspaceSize = e->ws;
        *executor = e;
    }
    fake_logf("{\"fn\":\"%s\",\"tensors\":{\"gradLoss\":%s,\"logProb\":%s,\"target\":%s,\"weightOptional\":%s,"
              "\"gradZlossOptional\":%s,\"lseForZlossOptional\":%s,\"xGradOut\":%s},"
              "\"attrs\":{\"reduction\":%s,\"ignoreIndex\":%lld,\"labelSmoothing\":%s,"
              "\"lseSquareScaleForZloss\":%s},\"workspaceSize\":%llu,\"executor\":%llu,\"ret\":%d}",
              fn, T(gradLoss), T(logProb), T(target), T(weightOptional), T(gradZlossOptional),
              T(lseForZlossOptional), T(xGradOut), red, (long long)ignoreIndex, ls, zs,
              (unsigned long long)(e ? e->ws : 0), (unsigned long long)(uintptr_t)e, ret);
    return ret;
}

FAKE_API int aclnnCrossEntropyLossGrad(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, void *stream) {
    return stage_two("aclnnCrossEntropyLossGrad", workspace, workspaceSize, executor, stream);
}

FAKE_API int aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize(
    const aclTensor *gradOutput, const aclTensor *y, const aclTensor *mask, double scale, bool fixTriuMask,
    aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    const char *fn = "aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize";
    B(gradOutput); B(y); B(mask); B(out);
    char sc[40];
    fmt_double(sc, sizeof sc, scale);
    int ret = stage_one_common(fn, workspaceSize, (void **)executor);
    /* op_api aclnn_scaled_masked_softmax_backward.cpp:47-52,155: CheckNotNull(gradOutput, y, mask,
     * out) -> ACLNN_ERR_PARAM_NULLPTR; the mask is required even with fixTriuMask */
    if (!ret && (!gradOutput || !y || !mask || !out)) ret = null_arg(fn, "gradOutput, y, mask and out");
    aclOpExecutor *e = NULL;
    if (!ret) {
        const aclTensor *ts[] = {gradOutput, y, mask, out};
        e = new_exec(OP_SMSB, ts, 4);
        e->f[0] = scale;
        e->b = fixTriuMask;
        *workspaceSize = e->ws;
        *executor = e;
    }
    fake_logf("{\"fn\":\"%s\",\"tensors\":{\"gradOutput\":%s,\"y\":%s,\"mask\":%s,\"out\":%s},"
              "\"attrs\":{\"scale\":%s,\"fixTriuMask\":%s},\"workspaceSize\":%llu,\"executor\":%llu,\"ret\":%d}",
              fn, T(gradOutput), T(y), T(mask), T(out), sc, fixTriuMask ? "true" : "false",
              (unsigned long long)(e ? e->ws : 0), (unsigned long long)(uintptr_t)e, ret);
    return ret;
}

FAKE_API int aclnnScaledMaskedSoftmaxBackward(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, void *stream) {
    return stage_two("aclnnScaledMaskedSoftmaxBackward", workspace, workspaceSize, executor, stream);
}

#ifndef FAKE_OMIT_SMOOTH_L1  /* an op library without the op (an older CANN) */
FAKE_API int aclnnSmoothL1LossBackwardGetWorkspaceSize(
    const aclTensor *gradOut, const aclTensor *self, const aclTensor *target, int64_t reduction, float beta,
    aclTensor *gradInput, uint64_t *workspaceSize, aclOpExecutor **executor) {
    const char *fn = "aclnnSmoothL1LossBackwardGetWorkspaceSize";
    B(gradOut); B(self); B(target); B(gradInput);
    char bs[40];
    fmt_double(bs, sizeof bs, beta);
    int ret = stage_one_common(fn, workspaceSize, (void **)executor);
    if (!ret && (!gradOut || !self || !target || !gradInput)) ret = null_arg(fn, "a required tensor");
    if (!ret && (reduction < 0 || reduction > 2)) { fake_set_errmsg("%s: reduction must be 0, 1 or 2", fn); ret = 161002; }
    if (!ret && beta < 0) { fake_set_errmsg("%s: beta must be >= 0", fn); ret = 161002; }
    aclOpExecutor *e = NULL;
    if (!ret) {
        const aclTensor *ts[] = {gradOut, self, target, gradInput};
        e = new_exec(OP_SL1B, ts, 4);
        e->i[0] = reduction;
        e->f[0] = beta;
        *workspaceSize = e->ws;
        *executor = e;
    }
    fake_logf("{\"fn\":\"%s\",\"tensors\":{\"gradOut\":%s,\"self\":%s,\"target\":%s,\"gradInput\":%s},"
              "\"attrs\":{\"reduction\":%lld,\"beta\":%s},\"workspaceSize\":%llu,\"executor\":%llu,\"ret\":%d}",
              fn, T(gradOut), T(self), T(target), T(gradInput), (long long)reduction, bs,
              (unsigned long long)(e ? e->ws : 0), (unsigned long long)(uintptr_t)e, ret);
    return ret;
}

#ifndef FAKE_OMIT_SMOOTH_L1_LAUNCH  /* ... or with its first call only */
FAKE_API int aclnnSmoothL1LossBackward(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, void *stream) {
    return stage_two("aclnnSmoothL1LossBackward", workspace, workspaceSize, executor, stream);
}
#endif
#endif

FAKE_API int aclnnEmbeddingDenseBackwardGetWorkspaceSize(
    const aclTensor *grad, const aclTensor *indices, uint64_t numWeights, uint64_t paddingIdx, bool scaleGradByFreq,
    const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    const char *fn = "aclnnEmbeddingDenseBackwardGetWorkspaceSize";
    B(grad); B(indices); B(out);
    int ret = stage_one_common(fn, workspaceSize, (void **)executor);
    if (!ret && (!grad || !indices || !out)) ret = null_arg(fn, "a required tensor");
    if (!ret && (out->ndim != 2 || (uint64_t)out->dims[0] != numWeights)) {
        fake_set_errmsg("%s: out must be [numWeights, D]", fn);
        ret = 161002;
    }
    aclOpExecutor *e = NULL;
    if (!ret) {
        const aclTensor *ts[] = {grad, indices, out};
        e = new_exec(OP_EMB, ts, 3);
        e->u[0] = numWeights;
        e->u[1] = paddingIdx;
        e->b = scaleGradByFreq;
        *workspaceSize = e->ws;
        *executor = e;
    }
    fake_logf("{\"fn\":\"%s\",\"tensors\":{\"grad\":%s,\"indices\":%s,\"out\":%s},"
              "\"attrs\":{\"numWeights\":%llu,\"paddingIdx\":%llu,\"scaleGradByFreq\":%s},"
              "\"workspaceSize\":%llu,\"executor\":%llu,\"ret\":%d}",
              fn, T(grad), T(indices), T(out), (unsigned long long)numWeights, (unsigned long long)paddingIdx,
              scaleGradByFreq ? "true" : "false", (unsigned long long)(e ? e->ws : 0),
              (unsigned long long)(uintptr_t)e, ret);
    return ret;
}

FAKE_API int aclnnEmbeddingDenseBackward(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, void *stream) {
    return stage_two("aclnnEmbeddingDenseBackward", workspace, workspaceSize, executor, stream);
}
#endif /* FAKE_PART_OPAPI */
