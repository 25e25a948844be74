/*
 * ferry._torchext: the high-throughput calls' host path for torch tensors,
 * optional. A normal-mode call made from Python spends most of its host
 * time around libferry, not in it: each output tensor made from Python
 * (torch.empty) and each ctypes struct cost microseconds that DeepEP's C++
 * binding does not pay. This module makes the outputs with ATen's
 * at::empty (a fraction of that) and calls libferry directly, through the
 * addresses of its functions that the Python package hands over (init),
 * so that it uses the library the package loaded.
 *
 * Every argument is checked by the Python caller (ferry/_ep.py,
 * ferry/_deep_ep_common.py, ferry/_deep_ep_normal.py) before it gets
 * here; this module only makes tensors and fills the structs of ferry.h.
 * libferry's errors come back as its status (the caller raises FerryError
 * with the context's message); ATen's (an allocation that fails:
 * torch.OutOfMemoryError) are raised as torch raises them.
 *
 * Built by `make pyext` (needs torch's headers; Makefile) into
 * python/ferry/; without it the Python package takes its own path
 * (FERRY_TORCH_EXT=0 forces that).
 */
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

extern "C" {
#include "ferry.h"
}

namespace {

using layout_fn = int (*)(const ferry_layout_args_t *, char *, size_t);
using route_create_fn = int (*)(ferry_ep_t, const ferry_route_in_t *, ferry_route_t *);
using route_counts_fn = int (*)(ferry_route_t, int *, int32_t *);
using ht_dispatch_fn = int (*)(ferry_ep_t, ferry_route_t, const ferry_ht_dispatch_in_t *,
                               const ferry_ht_dispatch_out_t *);
using ht_combine_fn = int (*)(ferry_ep_t, ferry_route_t, const ferry_ht_combine_in_t *,
                              const ferry_ht_combine_out_t *);
using route_destroy_fn = int (*)(ferry_route_t);

layout_fn g_layout;
route_create_fn g_route_create;
route_counts_fn g_route_counts;
ht_dispatch_fn g_ht_dispatch;
ht_combine_fn g_ht_combine;
route_destroy_fn g_route_destroy;

/* a Python int, a ctypes pointer (its value) or None (NULL) as a
 * pointer; else TypeError */
void *ptr_of(PyObject *o)
{
    if (o == Py_None)
        return nullptr;
    if (PyLong_Check(o))
        return PyLong_AsVoidPtr(o);
    PyObject *v = PyObject_GetAttrString(o, "value");
    if (!v || (v != Py_None && !PyLong_Check(v))) {
        Py_XDECREF(v);
        PyErr_Format(PyExc_TypeError, "ferry._torchext: expected an address (an int or a "
                     "ctypes pointer), got %s", Py_TYPE(o)->tp_name);
        return nullptr;
    }
    void *p = v == Py_None ? nullptr : PyLong_AsVoidPtr(v);
    Py_DECREF(v);
    return p;
}

long long int_of(PyObject *o)
{
    return PyLong_AsLongLong(o);
}

bool check_args(const char *what, Py_ssize_t n, Py_ssize_t want)
{
    if (n == want)
        return true;
    PyErr_Format(PyExc_TypeError, "ferry._torchext.%s: %zd arguments, expected %zd", what, n,
                 want);
    return false;
}

const at::Tensor *tensor_of(const char *what, PyObject *o)
{
    if (!THPVariable_Check(o)) {
        PyErr_Format(PyExc_TypeError, "ferry._torchext.%s: expected a torch tensor", what);
        return nullptr;
    }
    return &THPVariable_Unpack(o);
}

/* a plain torch.Tensor (not a subclass: no fake or wrapper tensors),
 * dense and strided (not nested, not sparse): else nullptr */
const at::Tensor *dense_of(PyObject *o)
{
    if (Py_TYPE(o) != reinterpret_cast<PyTypeObject *>(THPVariableClass))
        return nullptr;
    const at::Tensor &t = THPVariable_Unpack(o);
    if (!t.defined() || t.is_nested() || t.layout() != at::kStrided || !t.has_storage())
        return nullptr;
    return &t;
}

/* a tensor argument of the one-call paths (new_plain, layout_plain): a
 * dense torch.Tensor (dense_of) of dtype dt, 2-D, contiguous (or not,
 * where strided is allowed), on device dev (-1: the CPU, else that CUDA
 * device), of T rows and cols columns (either any, when < 0) */
const at::Tensor *plain_arg(PyObject *o, at::ScalarType dt, int dev, int64_t T, int64_t cols,
                            bool strided = false)
{
    const at::Tensor *tp = dense_of(o);
    if (!tp)
        return nullptr;
    const at::Tensor &t = *tp;
    if (t.scalar_type() != dt || t.dim() != 2 || (T >= 0 && t.size(0) != T) ||
        (cols >= 0 && t.size(1) != cols) || (!strided && !t.is_contiguous()))
        return nullptr;
    const at::Device d = t.device();
    if (dev < 0 ? !d.is_cpu() : !d.is_cuda() || d.index() != dev)
        return nullptr;
    return &t;
}

PyObject *wrap(at::Tensor t)
{
    return THPVariable_Wrap(std::move(t));
}

PyObject *wrap_opt(bool made, at::Tensor t)
{
    if (!made)
        Py_RETURN_NONE;
    return wrap(std::move(t));
}

void *data_of(const at::Tensor &t, bool made)
{
    return made && t.numel() ? t.data_ptr() : nullptr;
}

/* init(layout, route_create, route_counts, ht_dispatch, ht_combine,
 * route_destroy): the addresses of libferry's functions */
PyObject *init(PyObject *, PyObject *const *a, Py_ssize_t n)
{
    if (!check_args("init", n, 6))
        return nullptr;
    g_layout = reinterpret_cast<layout_fn>(ptr_of(a[0]));
    g_route_create = reinterpret_cast<route_create_fn>(ptr_of(a[1]));
    g_route_counts = reinterpret_cast<route_counts_fn>(ptr_of(a[2]));
    g_ht_dispatch = reinterpret_cast<ht_dispatch_fn>(ptr_of(a[3]));
    g_ht_combine = reinterpret_cast<ht_combine_fn>(ptr_of(a[4]));
    g_route_destroy = reinterpret_cast<route_destroy_fn>(ptr_of(a[5]));
    if (PyErr_Occurred())
        return nullptr;
    Py_RETURN_NONE;
}

/* layout(topk_idx, E, N, ranks_per_node, stream, device) -> (0, per_rank,
 * per_expert, in_rank, per_node or None), or (status, message).
 * topk_idx: contiguous int64 [T, K]; device: ferry_device_t */
PyObject *layout_c(const at::Tensor &idx, int E, int N, int rpn, void *stream, int dev)
{
    HANDLE_TH_ERRORS
    int64_t T = idx.size(0);
    int M = rpn > 0 ? (N + rpn - 1) / rpn : 0;
    auto i32 = idx.options().dtype(at::kInt);
    /* the counts in one allocation, back to back (one memset where the
     * library needs one) */
    at::Tensor counts = at::empty({N + E + M}, i32);
    at::Tensor per_rank = counts.narrow(0, 0, N), per_expert = counts.narrow(0, N, E);
    at::Tensor per_node = M ? counts.narrow(0, N + E, M) : at::Tensor();
    at::Tensor in_rank = at::empty({T, N}, idx.options().dtype(at::kBool));
    ferry_layout_args_t args = {};
    args.size = sizeof(args);
    args.device = (ferry_device_t)dev;
    args.num_tokens = (int)T;
    args.topk = (int)idx.size(1);
    args.num_experts = E;
    args.num_ranks = N;
    args.topk_idx = T ? idx.data_ptr<int64_t>() : nullptr;
    args.tokens_per_rank = per_rank.data_ptr<int32_t>();
    args.tokens_per_expert = per_expert.data_ptr<int32_t>();
    args.token_in_rank = T ? static_cast<uint8_t *>(in_rank.data_ptr()) : nullptr;
    args.stream = stream;
    args.ranks_per_node = rpn;
    args.tokens_per_node = M ? per_node.data_ptr<int32_t>() : nullptr;
    char msg[512];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = g_layout(&args, msg, sizeof(msg));
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return Py_BuildValue("(is)", rc, msg);
    PyObject *pn = M ? wrap(std::move(per_node)) : (Py_INCREF(Py_None), Py_None);
    return Py_BuildValue("(iNNNN)", 0, wrap(std::move(per_rank)), wrap(std::move(per_expert)),
                         wrap(std::move(in_rank)), pn);
    END_HANDLE_TH_ERRORS
}

PyObject *layout(PyObject *, PyObject *const *a, Py_ssize_t n)
{
    if (!check_args("layout", n, 6))
        return nullptr;
    const at::Tensor *idx = tensor_of("layout", a[0]);
    if (!idx)
        return nullptr;
    int E = (int)int_of(a[1]), N = (int)int_of(a[2]), rpn = (int)int_of(a[3]);
    void *stream = ptr_of(a[4]);
    int dev = (int)int_of(a[5]);
    if (PyErr_Occurred())
        return nullptr;
    return layout_c(*idx, E, N, rpn, stream, dev);
}

/* layout_plain(ctx, topk_idx, stream): get_dispatch_layout on one node
 * on the current stream (its handle: stream), where topk_idx is one the
 * Python path takes as it is (a contiguous int64 [T, K] tensor on the
 * device ctx names); else None. ctx: (E, N, device index (-1: the CPU),
 * anything after them unread).
 * Returns layout's tuple (per_node None). */
PyObject *layout_plain(PyObject *, PyObject *const *a, Py_ssize_t n)
{
    HANDLE_TH_ERRORS
    if (!check_args("layout_plain", n, 3))
        return nullptr;
    PyObject *ctx = a[0];
    if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) < 3) {
        PyErr_SetString(PyExc_TypeError, "ferry._torchext.layout_plain: ctx: expected a tuple "
                        "(E, N, device, ...)");
        return nullptr;
    }
    int E = (int)int_of(PyTuple_GET_ITEM(ctx, 0)), N = (int)int_of(PyTuple_GET_ITEM(ctx, 1));
    int dev = (int)int_of(PyTuple_GET_ITEM(ctx, 2));
    void *stream = ptr_of(a[2]);
    if (PyErr_Occurred())
        return nullptr;
    const at::Tensor *t = plain_arg(a[1], at::kLong, dev, -1, -1);
    if (!t)
        Py_RETURN_NONE;
    return layout_c(*t, E, N, 0, stream, dev < 0 ? FERRY_DEVICE_CPU : FERRY_DEVICE_CUDA);
    END_HANDLE_TH_ERRORS
}

/* route(ep, T, topk_idx_ptr, expert_alignment, stream, num_local_experts)
 * -> (0, route, num_recv, counts: a bytearray of int32 [E_local]) or (status,):
 * an exact route (ferry_route_create, then its counts) */
PyObject *route_c(ferry_ep_t ep, const ferry_route_in_t &in, Py_ssize_t el)
{
    PyObject *counts = PyByteArray_FromStringAndSize(nullptr, el * (Py_ssize_t)sizeof(int32_t));
    if (!counts)
        return nullptr;
    ferry_route_t r = nullptr;
    int num_recv = 0, rc;
    Py_BEGIN_ALLOW_THREADS
    rc = g_route_create(ep, &in, &r);
    if (rc == 0)
        rc = g_route_counts(r, &num_recv, reinterpret_cast<int32_t *>(PyByteArray_AS_STRING(counts)));
    Py_END_ALLOW_THREADS
    if (rc != 0 && !r) {
        Py_DECREF(counts);
        return Py_BuildValue("(i)", rc);
    }
    /* a route made whose counts failed is still returned, to be closed */
    return Py_BuildValue("(iNiN)", rc, PyLong_FromVoidPtr(r), num_recv, counts);
}

/* route's arguments (ep, T, topk_idx_ptr, expert_alignment, stream,
 * num_local_experts) read; false with Python's error set */
bool read_route_args(PyObject *const *a, ferry_ep_t *ep, ferry_route_in_t *in, Py_ssize_t *el)
{
    *ep = static_cast<ferry_ep_t>(ptr_of(a[0]));
    *in = {};
    in->size = sizeof(*in);
    in->num_tokens = (int)int_of(a[1]);
    in->topk_idx = static_cast<const int64_t *>(ptr_of(a[2]));
    in->expert_alignment = (int)int_of(a[3]);
    in->stream = ptr_of(a[4]);
    *el = (Py_ssize_t)int_of(a[5]);
    return !PyErr_Occurred();
}

PyObject *route(PyObject *, PyObject *const *a, Py_ssize_t n)
{
    ferry_ep_t ep;
    ferry_route_in_t in;
    Py_ssize_t el;
    if (!check_args("route", n, 6) || !read_route_args(a, &ep, &in, &el))
        return nullptr;
    return route_c(ep, in, el);
}

/* ht_dispatch(ep, route, num_recv, like, recv_x_dtype, x, x_scales,
 * stride0, stride1, topk_weights, stream, want, K, H) -> (status, recv_x,
 * recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_rank,
 * recv_src_token): the outputs made like `like` (its device; recv_x
 * [num_recv, H] of recv_x_dtype), then ferry_ht_dispatch.
 * x, x_scales, topk_weights: pointers (None: not given). want: bits, 1
 * fp8 (recv_x_scales), 2 recv_topk_idx, 4 as int64, 8 recv_topk_weights,
 * 16 recv_src_rank, 32 recv_src_token; K and H the context's top-k and
 * hidden size. The outputs are returned whatever
 * the status (unwritten when it is not 0). */
PyObject *dispatch_outputs(ferry_ep_t ep, ferry_route_t r, int64_t nr, PyObject *const *a);

PyObject *ht_dispatch(PyObject *, PyObject *const *a, Py_ssize_t n)
{
    if (!check_args("ht_dispatch", n, 14))
        return nullptr;
    ferry_ep_t ep = static_cast<ferry_ep_t>(ptr_of(a[0]));
    ferry_route_t r = static_cast<ferry_route_t>(ptr_of(a[1]));
    int64_t nr = int_of(a[2]);
    if (PyErr_Occurred())
        return nullptr;
    return dispatch_outputs(ep, r, nr, a + 3);
}

/* ht_dispatch's outputs made like `like` (recv_x [nr, H] of xdt; want's
 * bits as in ht_dispatch), then ferry_ht_dispatch of `in` on route r:
 * (status, the six outputs) */
PyObject *dispatch_c(ferry_ep_t ep, ferry_route_t r, int64_t nr, const at::Tensor &like,
                     at::ScalarType xdt, const ferry_ht_dispatch_in_t &in, long long want,
                     int64_t K, int64_t H)
{
    HANDLE_TH_ERRORS
    bool fp8 = want & 1, wi = want & 2, i64 = want & 4, ww = want & 8, wr = want & 16,
         wt = want & 32;
    auto opt = like.options();
    at::Tensor rx = at::empty({nr, H}, opt.dtype(xdt));
    at::Tensor rs, ri, rw, rr, rt;
    if (fp8)
        rs = at::empty({nr, H / 128}, opt.dtype(at::kFloat));
    if (wi)
        ri = at::empty({nr, K}, opt.dtype(i64 ? at::kLong : at::kInt));
    if (ww)
        rw = at::empty({nr, K}, opt.dtype(at::kFloat));
    if (wr)
        rr = at::empty({nr}, opt.dtype(at::kInt));
    if (wt)
        rt = at::empty({nr}, opt.dtype(at::kInt));
    ferry_ht_dispatch_out_t out = {};
    out.size = sizeof(out);
    out.recv_x = data_of(rx, true);
    out.recv_x_scales = static_cast<float *>(data_of(rs, fp8));
    void *pi = data_of(ri, wi);
    out.recv_topk_idx = i64 ? nullptr : static_cast<int32_t *>(pi);
    out.recv_topk_idx_i64 = i64 ? static_cast<int64_t *>(pi) : nullptr;
    out.recv_topk_weights = static_cast<float *>(data_of(rw, ww));
    out.recv_src_rank = static_cast<int32_t *>(data_of(rr, wr));
    out.recv_src_token = static_cast<int32_t *>(data_of(rt, wt));
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = g_ht_dispatch(ep, r, &in, &out);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(iNNNNNN)", rc, wrap(std::move(rx)), wrap_opt(fp8, std::move(rs)),
                         wrap_opt(wi, std::move(ri)), wrap_opt(ww, std::move(rw)),
                         wrap_opt(wr, std::move(rr)), wrap_opt(wt, std::move(rt)));
    END_HANDLE_TH_ERRORS
}

/* ht_dispatch's arguments from `like` on (a[0] like, a[1] recv_x_dtype,
 * a[2..8] x, x_scales, the strides, topk_weights, stream, want, a[9] K,
 * a[10] H) into the struct and values dispatch_c takes; false with
 * Python's error set */
struct dispatch_args {
    const at::Tensor *like;
    at::ScalarType xdt;
    ferry_ht_dispatch_in_t in;
    long long want;
    int64_t K, H;
};

bool read_dispatch_args(const char *what, PyObject *const *a, dispatch_args *d)
{
    if (!(d->like = tensor_of(what, a[0])))
        return false;
    if (!THPDtype_Check(a[1])) {
        PyErr_Format(PyExc_TypeError, "ferry._torchext.%s: recv_x_dtype: expected a torch "
                     "dtype", what);
        return false;
    }
    d->xdt = reinterpret_cast<THPDtype *>(a[1])->scalar_type;
    ferry_ht_dispatch_in_t &in = d->in;
    in = {};
    in.size = sizeof(in);
    in.x = ptr_of(a[2]);
    in.x_scales = static_cast<const float *>(ptr_of(a[3]));
    in.x_scales_stride[0] = int_of(a[4]);
    in.x_scales_stride[1] = int_of(a[5]);
    in.topk_weights = static_cast<const float *>(ptr_of(a[6]));
    in.stream = ptr_of(a[7]);
    d->want = int_of(a[8]);
    d->K = int_of(a[9]);
    d->H = int_of(a[10]);
    return !PyErr_Occurred();
}

/* ht_dispatch's work from `like` on: the arguments read, then dispatch_c */
PyObject *dispatch_outputs(ferry_ep_t ep, ferry_route_t r, int64_t nr, PyObject *const *a)
{
    dispatch_args d;
    if (!read_dispatch_args("ht_dispatch", a, &d))
        return nullptr;
    return dispatch_c(ep, r, nr, *d.like, d.xdt, d.in, d.want, d.K, d.H);
}

/* route_c's tuple extended with dispatch_c's once the route was made
 * whole: (0, route, num_recv, counts, status, the six outputs); else
 * route_c's. A failure after the route was made (Python never sees it)
 * destroys the route. */
PyObject *route_then_dispatch(ferry_ep_t ep, const ferry_route_in_t &rin, Py_ssize_t el,
                              const at::Tensor &like, at::ScalarType xdt,
                              const ferry_ht_dispatch_in_t &din, long long want, int64_t K,
                              int64_t H)
{
    PyObject *rt = route_c(ep, rin, el);
    if (!rt || PyTuple_GET_SIZE(rt) != 4 || PyLong_AsLong(PyTuple_GET_ITEM(rt, 0)) != 0)
        return rt;
    ferry_route_t r = static_cast<ferry_route_t>(PyLong_AsVoidPtr(PyTuple_GET_ITEM(rt, 1)));
    int64_t nr = PyLong_AsLongLong(PyTuple_GET_ITEM(rt, 2));
    PyObject *d = PyErr_Occurred() ? nullptr : dispatch_c(ep, r, nr, like, xdt, din, want, K, H);
    PyObject *both = d ? PySequence_Concat(rt, d) : nullptr;
    Py_DECREF(rt);
    Py_XDECREF(d);
    if (!both)
        g_route_destroy(r);
    return both;
}

/* route_dispatch(ep, T, topk_idx_ptr, expert_alignment, stream,
 * num_local_experts, like, recv_x_dtype, x, x_scales, stride0, stride1,
 * topk_weights, stream, want, K, H): route's work, then on its route
 * ht_dispatch's (a new routing's two calls in one, the host wait between
 * them in the library). Returns route's tuple, extended with ht_dispatch's
 * when the route was made whole: (0, route, num_recv, counts, status,
 * the six outputs). */
PyObject *route_dispatch(PyObject *, PyObject *const *a, Py_ssize_t n)
{
    ferry_ep_t ep;
    ferry_route_in_t rin;
    Py_ssize_t el;
    if (!check_args("route_dispatch", n, 17) || !read_route_args(a, &ep, &rin, &el))
        return nullptr;
    dispatch_args d;
    if (!read_dispatch_args("route_dispatch", a + 6, &d))
        return nullptr;
    return route_then_dispatch(ep, rin, el, *d.like, d.xdt, d.in, d.want, d.K, d.H);
}

/* new_plain(ctx, x, topk_idx, topk_weights, per_expert, per_rank,
 * in_rank, expert_alignment, stream, alloc): deep_ep's dispatch of a new
 * routing in one call, where every argument is one the Python path takes
 * as it is (ferry/_deep_ep_normal.py, _new_plain); else None (the Python
 * path then, which converts, warns or raises). ctx: (ep, N, E_local, K, H,
 * device (-1: CPU), want) of the context the last such call used; stream:
 * the launches' (a handle); alloc: None (the outputs made on the current
 * stream) or the (stream_id, device_index, device_type) of the stream
 * they are made on (the Buffer's comm stream). Returns route_dispatch's
 * tuple. */
PyObject *new_plain(PyObject *, PyObject *const *a, Py_ssize_t n)
{
    HANDLE_TH_ERRORS
    if (!check_args("new_plain", n, 10))
        return nullptr;
    PyObject *ctx = a[0];
    if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) != 7) {
        PyErr_SetString(PyExc_TypeError, "ferry._torchext.new_plain: ctx: expected a 7-tuple");
        return nullptr;
    }
    ferry_ep_t ep = static_cast<ferry_ep_t>(PyLong_AsVoidPtr(PyTuple_GET_ITEM(ctx, 0)));
    int64_t N = int_of(PyTuple_GET_ITEM(ctx, 1)), El = int_of(PyTuple_GET_ITEM(ctx, 2));
    int64_t K = int_of(PyTuple_GET_ITEM(ctx, 3)), H = int_of(PyTuple_GET_ITEM(ctx, 4));
    int dev = (int)int_of(PyTuple_GET_ITEM(ctx, 5));
    long long want = int_of(PyTuple_GET_ITEM(ctx, 6));
    if (PyErr_Occurred())
        return nullptr;
    int over = 0;
    long long align = PyLong_Check(a[7]) ? PyLong_AsLongLongAndOverflow(a[7], &over) : -1;
    if (PyErr_Occurred())
        return nullptr;
    if (over || align < 1 || align > INT32_MAX || PyBool_Check(a[7]))
        Py_RETURN_NONE; /* the Python path names it */
    /* x: bf16 rows, or (fp8 rows, float32 scales [T, H/128]) */
    const at::Tensor *x, *xs = nullptr;
    int64_t s0 = 0, s1 = 0;
    if (PyTuple_Check(a[1])) {
        if (PyTuple_GET_SIZE(a[1]) != 2 ||
            !(x = plain_arg(PyTuple_GET_ITEM(a[1], 0), at::kFloat8_e4m3fn, dev, -1, H)) ||
            !(xs = plain_arg(PyTuple_GET_ITEM(a[1], 1), at::kFloat, dev, x->size(0), H / 128,
                             true)))
            Py_RETURN_NONE;
        if (!xs->is_contiguous()) { /* strided: element strides, each at least 1, aligned */
            s0 = xs->size(0) == 1 ? 1 : xs->stride(0);
            s1 = xs->size(1) == 1 ? 1 : xs->stride(1);
            if (s0 < 1 || s1 < 1 || reinterpret_cast<uintptr_t>(xs->data_ptr()) % 4)
                Py_RETURN_NONE;
        }
        want |= 1;
    } else if (!(x = plain_arg(a[1], at::kBFloat16, dev, -1, H)))
        Py_RETURN_NONE;
    int64_t T = x->size(0);
    const at::Tensor *idx = plain_arg(a[2], at::kLong, dev, T, K), *w = nullptr;
    if (!T || T > INT32_MAX || !idx)
        Py_RETURN_NONE;
    if (a[3] != Py_None) {
        if (!(w = plain_arg(a[3], at::kFloat, dev, T, K)))
            Py_RETURN_NONE;
        want |= 8;
    }
    /* the layout's counts: per expert (E of them: E_local per rank), per
     * rank (N), is_token_in_rank (a tensor, kept by the handle) */
    const at::Tensor *pe = dense_of(a[4]), *pr = dense_of(a[5]);
    if (!pe || pe->numel() != El * N || !pr || pr->numel() != N || !THPVariable_Check(a[6]))
        Py_RETURN_NONE;
    void *stream = ptr_of(a[8]);
    if (PyErr_Occurred())
        return nullptr;
    ferry_route_in_t rin = {};
    rin.size = sizeof(rin);
    rin.num_tokens = (int)T;
    rin.topk_idx = idx->data_ptr<int64_t>();
    rin.expert_alignment = (int)align;
    rin.stream = stream;
    ferry_ht_dispatch_in_t din = {};
    din.size = sizeof(din);
    din.x = x->data_ptr();
    din.x_scales = xs ? static_cast<const float *>(xs->data_ptr()) : nullptr;
    din.x_scales_stride[0] = s0;
    din.x_scales_stride[1] = s1;
    din.topk_weights = w ? static_cast<const float *>(w->data_ptr()) : nullptr;
    din.stream = stream;
    c10::OptionalStreamGuard on; /* the outputs made on alloc's stream, when given */
    if (a[9] != Py_None) {
        long long sid = 0, sidx = 0, stype = 0;
        if (!PyArg_ParseTuple(a[9], "LLL", &sid, &sidx, &stype))
            return nullptr;
        on.reset_stream(c10::Stream::unpack3(static_cast<c10::StreamId>(sid),
                                              static_cast<c10::DeviceIndex>(sidx),
                                              static_cast<c10::DeviceType>(stype)));
    }
    return route_then_dispatch(ep, rin, (Py_ssize_t)El, *x, x->scalar_type(), din, want, K, H);
    END_HANDLE_TH_ERRORS
}

/* ht_combine(ep, route, T, K, like, y, topk_weights, want_w, stream,
 * weights_sum, bias0, bias1, order, H) -> (status, out, weights or None):
 * out [T, H] bf16 (and [T, K] float32 weights with want_w)
 * made like `like`, then ferry_ht_combine. Pointers as in ht_dispatch. */
PyObject *ht_combine(PyObject *, PyObject *const *a, Py_ssize_t n)
{
    HANDLE_TH_ERRORS
    if (!check_args("ht_combine", n, 14))
        return nullptr;
    ferry_ep_t ep = static_cast<ferry_ep_t>(ptr_of(a[0]));
    ferry_route_t r = static_cast<ferry_route_t>(ptr_of(a[1]));
    int64_t T = int_of(a[2]), K = int_of(a[3]);
    const at::Tensor *like = tensor_of("ht_combine", a[4]);
    if (!like)
        return nullptr;
    ferry_ht_combine_in_t in = {};
    in.size = sizeof(in);
    in.y = ptr_of(a[5]);
    in.topk_weights = static_cast<const float *>(ptr_of(a[6]));
    bool want_w = PyObject_IsTrue(a[7]) == 1;
    in.stream = ptr_of(a[8]);
    in.weights_sum = (int)int_of(a[9]);
    in.bias[0] = ptr_of(a[10]);
    in.bias[1] = ptr_of(a[11]);
    in.sum_order = (int)int_of(a[12]);
    int64_t H = int_of(a[13]);
    if (PyErr_Occurred())
        return nullptr;
    auto opt = like->options();
    at::Tensor o = at::empty({T, H}, opt.dtype(at::kBFloat16));
    at::Tensor w;
    if (want_w)
        w = at::empty({T, K}, opt.dtype(at::kFloat));
    ferry_ht_combine_out_t out = {};
    out.size = sizeof(out);
    out.out = data_of(o, true);
    out.topk_weights = static_cast<float *>(data_of(w, want_w));
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = g_ht_combine(ep, r, &in, &out);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(iNN)", rc, wrap(std::move(o)), wrap_opt(want_w, std::move(w)));
    END_HANDLE_TH_ERRORS
}

/* t.record_stream(s) for each CUDA tensor of the sequence obj (anything
 * else skipped). */
bool record_seq(PyObject *obj, const c10::Stream &s)
{
    PyObject *seq = PySequence_Fast(obj, "ferry._torchext: tensors: expected a sequence");
    if (!seq)
        return false;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    try {
        for (Py_ssize_t i = 0; i < k; i++) {
            if (!THPVariable_Check(items[i]))
                continue;
            const at::Tensor &t = THPVariable_Unpack(items[i]);
            if (t.defined() && t.is_cuda())
                t.record_stream(s);
        }
    } catch (...) {
        Py_DECREF(seq);
        throw;
    }
    Py_DECREF(seq);
    return true;
}

/* One event per device for stream waits (a stream waits for what another
 * had queued when the event was recorded: cudaStreamWaitEvent takes the
 * event's state at the call, so one event serves every wait in turn).
 * Kept for the process's life. */
void *g_wait_ev[256];

/* b waits for the work queued on a so far. */
void stream_wait(const c10::impl::DeviceGuardImplInterface *g, const c10::Stream &b,
                 const c10::Stream &a)
{
    void **ev = &g_wait_ev[static_cast<uint8_t>(a.device_index())];
    g->record(ev, a, a.device_index(), c10::EventFlag::PYTORCH_DEFAULT);
    g->block(*ev, b);
}

/* The stream of torch.cuda.Stream's three fields a[0..2]; false with
 * Python's error set where one is not an int. */
bool stream_of(PyObject *const *a, c10::Stream *s)
{
    long long id = int_of(a[0]), index = int_of(a[1]), type = int_of(a[2]);
    if (PyErr_Occurred())
        return false;
    *s = c10::Stream::unpack3(static_cast<c10::StreamId>(id),
                              static_cast<c10::DeviceIndex>(index),
                              static_cast<c10::DeviceType>(type));
    return true;
}

/* call_begin(comm_stream_id, device_index, device_type, event): the
 * stream waits of a normal-mode call on the Buffer's comm stream (_Call):
 * the comm stream waits for event (a torch.cuda.Event's cuda_event handle;
 * 0, an event never recorded: no wait) or, event None, for the device's
 * current stream. Returns the current stream's id (the caller's compute
 * stream). Three torch calls from Python, one here. */
PyObject *call_begin(PyObject *, PyObject *const *a, Py_ssize_t n)
{
    HANDLE_TH_ERRORS
    if (!check_args("call_begin", n, 4))
        return nullptr;
    c10::Stream comm(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU));
    if (!stream_of(a, &comm))
        return nullptr;
    unsigned long long ev = a[3] == Py_None ? 0 : PyLong_AsUnsignedLongLong(a[3]);
    if (PyErr_Occurred())
        return nullptr;
    const c10::impl::DeviceGuardImplInterface *g = c10::impl::getDeviceGuardImpl(comm.device_type());
    c10::Stream cur = g->getStream(comm.device());
    if (a[3] == Py_None)
        stream_wait(g, comm, cur);
    else if (ev != 0)
        g->block(reinterpret_cast<void *>(static_cast<uintptr_t>(ev)), comm);
    return PyLong_FromLongLong(static_cast<long long>(cur.id()));
    END_HANDLE_TH_ERRORS
}

/* call_end(compute_stream_id, comm_stream_id, device_index, device_type,
 * made, read, async_finish): a call's end on the comm stream (_Call.finish
 * without its event): the tensors it made recorded for the compute
 * stream; with async_finish the caller's tensors it read recorded for the
 * comm stream, else the compute stream waits for the comm stream. */
PyObject *call_end(PyObject *, PyObject *const *a, Py_ssize_t n)
{
    HANDLE_TH_ERRORS
    if (!check_args("call_end", n, 7))
        return nullptr;
    long long cs = int_of(a[0]), ms = int_of(a[1]), index = int_of(a[2]), type = int_of(a[3]);
    int async_finish = PyObject_IsTrue(a[6]);
    if (PyErr_Occurred() || async_finish < 0)
        return nullptr;
    auto dt = static_cast<c10::DeviceType>(type);
    auto di = static_cast<c10::DeviceIndex>(index);
    c10::Stream compute = c10::Stream::unpack3(static_cast<c10::StreamId>(cs), di, dt);
    c10::Stream comm = c10::Stream::unpack3(static_cast<c10::StreamId>(ms), di, dt);
    if (!record_seq(a[4], compute))
        return nullptr;
    if (async_finish) {
        if (!record_seq(a[5], comm))
            return nullptr;
    } else {
        stream_wait(c10::impl::getDeviceGuardImpl(dt), compute, comm);
    }
    Py_RETURN_NONE;
    END_HANDLE_TH_ERRORS
}

/* record(stream_id, device_index, device_type, tensors): t.record_stream
 * on that stream (torch.cuda.Stream's three fields) for each CUDA tensor
 * of the sequence tensors (anything else skipped): the caching allocator
 * keeps their memory until the stream's work queued before their release
 * is done. One call for the dozen tensors of an async normal-mode call
 * (half the time of as many calls from Python). */
PyObject *record(PyObject *, PyObject *const *a, Py_ssize_t n)
{
    HANDLE_TH_ERRORS
    if (!check_args("record", n, 4))
        return nullptr;
    c10::Stream s(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU));
    if (!stream_of(a, &s) || !record_seq(a[3], s))
        return nullptr;
    Py_RETURN_NONE;
    END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"init", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(init)),
     METH_FASTCALL, "init(layout, route_create, route_counts, ht_dispatch, ht_combine)"},
    {"layout", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(layout)),
     METH_FASTCALL, "get_dispatch_layout's outputs and ferry_dispatch_layout"},
    {"layout_plain",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(layout_plain)),
     METH_FASTCALL, "get_dispatch_layout on one node on the current stream, or None"},
    {"route", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(route)),
     METH_FASTCALL, "ferry_route_create and ferry_route_counts of an exact route"},
    {"route_dispatch",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(route_dispatch)),
     METH_FASTCALL, "route, then ht_dispatch on it"},
    {"new_plain", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(new_plain)),
     METH_FASTCALL, "deep_ep's plain dispatch of a new routing, or None"},
    {"ht_dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(ht_dispatch)),
     METH_FASTCALL, "a dispatch's outputs and ferry_ht_dispatch"},
    {"ht_combine", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(ht_combine)),
     METH_FASTCALL, "a combine's outputs and ferry_ht_combine"},
    {"record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(record)),
     METH_FASTCALL, "record_stream of CUDA tensors on one stream"},
    {"call_begin", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(call_begin)),
     METH_FASTCALL, "a normal-mode call's comm stream waits; the current stream's id"},
    {"call_end", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(call_end)),
     METH_FASTCALL, "a normal-mode call's records and, not async, the compute stream's wait"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_torchext",
                      "ferry's high-throughput host path for torch tensors (optional)", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__torchext(void)
{
    return PyModule_Create(&module);
}
