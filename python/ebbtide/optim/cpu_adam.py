"""CPUAdam: Adam/AdamW on the CPU through ebbtide's SIMD kernel, as a drop-in ``torch.optim.Optimizer``.

Contract:
- Params are CPU fp32 contiguous tensors (the fp32 masters); gradients are CPU, contiguous, of the param's shape, fp32
  or bf16 (read, never written). State per param is torch's: ``step`` (float32 0-dim tensor), ``exp_avg``,
  ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), so ``state_dict`` moves between this class and
  ``torch.optim.AdamW``/``Adam`` both ways.
- ``mode="exact"``: p, m, v bit-identical to ``torch.optim.AdamW(foreach=False)`` (``adamw=True``) or
  ``torch.optim.Adam`` (``adamw=False``) in fp32, for float lr or a float32/float64 tensor lr, on every ISA and
  thread count. Betas given as tensors are read as floats (torch then computes bias corrections in tensor
  arithmetic, which exact mode does not replicate). ``mode="fast"``: fused arithmetic, error bound tested.
- ``moments_dtype=torch.bfloat16``: ``exp_avg`` and ``exp_avg_sq`` are kept as bf16 (the master stays fp32): 20
  instead of 28 bytes of host memory traffic per element and step. Each step reads them as fp32, computes exactly
  as the fp32 path does and stores the new moments rounded to nearest even, so in ``exact`` mode p is
  bit-identical to torch's AdamW on fp32 copies of the moments and the new moments to that result's
  ``.to(torch.bfloat16)`` (optim/adam_kernel.h Note [bf16 moments]). Not with amsgrad. Loaded fp32 moments are
  rounded the same way; ``state_dict`` carries the bf16 tensors.
- One native call per param group per step; the kernel runs on the optimizer's own thread pool (``threads``,
  default the process's CPU affinity count divided by ``LOCAL_WORLD_SIZE`` where a launcher such as torchrun sets
  it: the ranks of one host step at the same time and share its cores and memory bandwidth;
  OMP_NUM_THREADS and torch.set_num_threads do not apply).
- ``attach_bf16_copy(param, target)`` makes every step also write ``param.to(bfloat16)`` into ``target`` in the
  same pass (bit-equal to ``.to(torch.bfloat16)``; NaN becomes 0xFFFF as torch's x86 conversion writes).
- ``step(grad_scale=s)`` multiplies gradients by ``s`` first (1/loss_scale, or a clip coefficient);
  ``skip_non_finite=True`` skips the whole step (no state, no step count changes) if any scaled gradient of a group
  is Inf/NaN; ``last_step_applied`` then reads False for that group.
- Bad input (a CUDA or non-contiguous param, a param passed twice or overlapping another, a hyper-parameter of
  the wrong type or range in any group, a grad of another dtype or shape, loaded state of another shape) raises
  InvalidArgumentError before any state changes; the rules are listed in ``ebbtide.optim._validate``.
"""
from __future__ import annotations

import functools
import os
import threading
import warnings

import torch

from .. import _native, settings
from ..errors import InvalidArgumentError
from ._validate import (MODES, STATE_TENSORS, check_distinct, check_grad_scale, check_group, check_groups,
                        check_state_dict, param_list, scalar_value)

__all__ = ["CPUAdam", "KernelViews", "available_isas", "torch_sqrt_flavor", "probe_torch_sqrt_flavor"]

MOMENTS_DTYPES = (torch.float32, torch.bfloat16)


def check_moments_dtype(moments_dtype, amsgrad, owner: str) -> torch.dtype:
    """The ``moments_dtype`` argument (float32 or bfloat16; bf16 moments exclude amsgrad)."""
    if moments_dtype not in MOMENTS_DTYPES:
        raise InvalidArgumentError(f"{owner}: moments_dtype must be torch.float32 or torch.bfloat16 (got "
                                   f"{moments_dtype!r})")
    if moments_dtype == torch.bfloat16 and amsgrad:
        raise InvalidArgumentError(f"{owner}: amsgrad needs fp32 moments (moments_dtype=torch.bfloat16 given)")
    return moments_dtype

_MODES = MODES


def available_isas() -> list[str]:
    """Kernel ISAs this CPU can run, best first (e.g. ['avx512_bf16', 'avx512', 'avx2', 'scalar'])."""
    return list(_native.load().optim.available_isas())


@functools.lru_cache(maxsize=None)
def probe_torch_sqrt_flavor() -> int | None:
    """Which sqrt torch's CPU ``Tensor.sqrt`` computes in this process: 0 correctly rounded, 1 MKL's AVX-512
    vsSqrt, 2 MKL's generic SSE2 vsSqrt (non-Intel CPUs); None if none of them (optim/adam_kernel.h, Note [torch's
    sqrt]). Found once by comparing torch.sqrt bit for bit, on 64K log-uniform probes plus the edges of MKL's
    fast range, with each flavor this CPU can evaluate."""
    from ..errors import UnsupportedError

    C = _native.load()
    x = _sqrt_probes()
    ref = x.sqrt()
    for flavor in (0, 1, 2):
        out = torch.empty_like(x)
        try:
            C.optim.sqrt_flavor_eval(flavor, x.data_ptr(), out.data_ptr(), x.numel())
        except UnsupportedError:
            continue
        if torch.equal(out, ref):
            return flavor
    return None


def _sqrt_probes() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    spread = torch.exp2(torch.empty(1 << 16, dtype=torch.float64).uniform_(-110.0, 30.0, generator=gen)).float()
    # zero, subnormals, the smallest normals and the top of the float range: where MKL leaves its fast path
    edges = torch.tensor([0x0, 0x1, 0x3FF, 0x7FFFFF, 0x800000, 0x800001, 0x7F7FEFFF, 0x7F7FF000, 0x7F7FF001,
                          0x7F7FFFFF], dtype=torch.int32).view(torch.float32)
    return torch.cat([spread, edges])


def torch_sqrt_flavor() -> int:
    """The sqrt flavor exact mode uses: torch's, or IEEE (with a warning) when torch's is unknown."""
    flavor = probe_torch_sqrt_flavor()
    if flavor is None:
        warnings.warn("ebbtide.optim: torch.sqrt on this machine matches none of the sqrt flavors exact mode knows "
                      "(IEEE, MKL's AVX-512 and generic SSE2 kernels); exact mode uses IEEE sqrt and may differ "
                      "from torch by an ulp in some elements", RuntimeWarning, stacklevel=2)
        return 0
    return flavor


TASKS_PER_THREAD = settings.declare(
    "EBBTIDE_ADAM_TASKS_PER_THREAD", settings.parse_int(1, 256), 16,
    "ranges per pool thread in one CPU Adam call: 1 gives each thread one contiguous range; more are claimed by "
    "whichever thread is free, so a preempted thread delays the call by one range, not by its whole share")

_ENGINES: dict[tuple[int, str, int], object] = {}
_ENGINES_LOCK = threading.Lock()  # guards _ENGINES


def default_threads() -> int | None:
    """The pool's size when none is given: None (the native default, every CPU of the affinity mask) in a process
    alone on its host, else that count divided by ``LOCAL_WORLD_SIZE`` (at least 1). A value that is not a positive
    integer raises InvalidArgumentError."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not raw:
        return None
    try:
        local = int(raw)
    except ValueError:
        local = 0
    if local < 1:
        raise InvalidArgumentError(f"LOCAL_WORLD_SIZE must be a positive integer (the ranks on this host), got {raw!r}")
    if local == 1:
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // local)


def shared_engine(threads: int | None, isa: str | None):
    """One native engine (and thread pool) per (threads, isa, tasks per thread) per process: optimizers share it,
    so wrappers that build one optimizer per parameter (Megatron's HybridDeviceOptimizer) do not create a pool each.
    Calls on an engine are serialized natively. ``threads=None``: :func:`default_threads`."""
    if threads is None:
        threads = default_threads()
    key = (threads or 0, isa or "", settings.get(TASKS_PER_THREAD))
    with _ENGINES_LOCK:
        eng = _ENGINES.get(key)
        if eng is None:
            eng = _native.load().optim.AdamEngine(*key)
            _ENGINES[key] = eng
        return eng


@functools.lru_cache(maxsize=None)
def torch_bc2_sqrt_is_pow() -> bool:
    """True when this torch's _single_tensor_adam takes sqrt(1 - beta2^t) as ``** 0.5`` (a pow call, torch >= 2.5)
    rather than math.sqrt (older releases); the two can differ in the last bit of the double."""
    import inspect  # noqa: PLC0415

    try:
        src = inspect.getsource(torch.optim.adam._single_tensor_adam)
    except (OSError, TypeError, AttributeError):
        return True
    return "_dispatch_sqrt(bias_correction2)" not in src and "math.sqrt(bias_correction2)" not in src


def _check_hyper(lr, betas, eps, weight_decay, mode, where: str = "optimizer", **flags):
    """The constructor's hyper-parameters (the rules of ebbtide.optim._validate)."""
    check_group(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, mode=mode, **flags), where)


def _check_threads_isa(threads, isa) -> None:
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise InvalidArgumentError(f"threads must be a positive int or None (got {threads!r})")
    if isa is not None and not isinstance(isa, str):
        raise InvalidArgumentError(f"isa must be a name such as 'avx2', or None (got {isa!r})")


def make_hyper(group: dict, *, grad_scale: float = 1.0, skip_non_finite: bool = False):
    """The native hyper-parameter record of one param group (shared with OffloadedAdam). The group has passed
    ``check_group``."""
    C = _native.load()
    h = C.optim.AdamHyper()
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        h.lr_f32 = lr.dtype == torch.float32
    h.lr = scalar_value(lr, "lr")
    b1, b2 = group["betas"]
    h.beta1, h.beta2 = scalar_value(b1, "betas[0]"), scalar_value(b2, "betas[1]")
    h.eps = float(group["eps"])
    h.weight_decay = float(group["weight_decay"])
    h.adamw = bool(group.get("decoupled_weight_decay", True))
    h.amsgrad = bool(group.get("amsgrad", False))
    h.maximize = bool(group.get("maximize", False))
    h.exact = group.get("mode", "fast") == "exact"
    h.grad_scale = float(grad_scale)
    h.skip_non_finite = bool(skip_non_finite)
    h.sqrt_flavor = torch_sqrt_flavor() if h.exact else 0
    h.bc2_sqrt_pow = torch_bc2_sqrt_is_pow()
    return h


class KernelViews:
    """What CPUAdam, OffloadedAdam and ShardedAdam show of their kernel: the engine (``_engine``, made on first use
    from ``_threads``/``_isa`` where construction left it None), its threads and ISA, and the moments' dtype."""

    @property
    def moments_dtype(self) -> torch.dtype:
        """dtype of ``exp_avg`` and ``exp_avg_sq`` (float32 or bfloat16)."""
        return self._moments_dtype

    @property
    def engine(self):
        """The native kernel and its thread pool (``.threads``, ``.isa``)."""
        if self._engine is None:
            self._engine = shared_engine(self._threads, self._isa)
        return self._engine

    @property
    def threads(self) -> int:
        return self.engine.threads

    @property
    def isa(self) -> str:
        return self.engine.isa


class CPUAdam(KernelViews, torch.optim.Optimizer):
    """Adam/AdamW with fp32 master weights and state in host memory, stepped by ebbtide's SIMD kernel."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True,
                 amsgrad=False, maximize=False, mode="fast", threads=None, isa=None, moments_dtype=torch.float32):
        _check_hyper(lr, betas, eps, weight_decay, mode, "CPUAdam", amsgrad=amsgrad, maximize=maximize,
                     decoupled_weight_decay=adamw)
        _check_threads_isa(threads, isa)
        self._moments_dtype = check_moments_dtype(moments_dtype, amsgrad, "CPUAdam")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=bool(amsgrad),
                        maximize=bool(maximize), decoupled_weight_decay=bool(adamw), mode=mode)
        params = param_list(params, "CPUAdam")
        self._threads = threads
        self._isa = isa or ""
        self._engine = None
        self._copy_out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last_step_applied: list[bool] = []
        super().__init__(params, defaults)  # every group passes through add_param_group's checks
        self.engine  # create the pool now: a bad isa/threads fails here, not at the first step

    # ---- torch.optim.Optimizer protocol ----------------------------------------------------------------------
    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # groups loaded from torch.optim.Adam(W) lack our keys
            group.setdefault("mode", self.defaults.get("mode", "fast"))
            group.setdefault("decoupled_weight_decay", self.defaults.get("decoupled_weight_decay", True))
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
        if not hasattr(self, "_engine"):
            self._engine = None
            self._threads, self._isa = None, ""
            self._copy_out, self.last_step_applied = {}, []
        if not hasattr(self, "_moments_dtype"):
            self._moments_dtype = torch.float32

    def add_param_group(self, param_group):
        """torch's add_param_group, after checking the group's params (tensors we can step, none already held,
        none overlapping another) and hyper-parameters; a refused group is not added."""
        if not isinstance(param_group, dict):
            raise InvalidArgumentError(f"a param group must be a dict (got {type(param_group).__name__})")
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, (set, frozenset)) or params is None or isinstance(params, (str, bytes, dict)):
            raise InvalidArgumentError("a param group's 'params' must be a tensor or an ordered collection of "
                                       f"tensors (got {type(params).__name__})")
        params = list(params)
        check_distinct(params, [p for g in self.param_groups for p in g["params"]])
        for p in params:
            self._check_param(p)
        check_group(param_group, f"param_groups[{len(self.param_groups)}]")
        if param_group.get("amsgrad") and getattr(self, "_moments_dtype", torch.float32) != torch.float32:
            raise InvalidArgumentError(f"param_groups[{len(self.param_groups)}]: amsgrad needs fp32 moments "
                                       "(this optimizer keeps bf16 moments)")
        super().add_param_group({**param_group, "params": params})

    def load_state_dict(self, state_dict):
        """torch's load_state_dict, after checking every group's hyper-parameters and every state tensor's shape
        against its param (a mismatch is refused, never reshaped)."""
        check_state_dict(state_dict, self.param_groups)
        super().load_state_dict(state_dict)
        # torch casts loaded state to the param's dtype (fp32): bf16 moments go back to bf16 (exact), fp32 ones
        # from another optimizer are rounded to nearest even.
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                t = state.get(key)
                if isinstance(t, torch.Tensor) and t.dtype != self._moments_dtype:
                    state[key] = t.to(self._moments_dtype)

    def attach_bf16_copy(self, param: torch.Tensor, target: torch.Tensor | None) -> None:
        """Write each step's new ``param`` as bf16 into ``target`` (CPU, contiguous, bf16, same shape; e.g. a
        pinned staging tensor) in the same pass. ``None`` detaches."""
        if target is None:
            self._copy_out.pop(id(param), None)
            return
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise InvalidArgumentError("attach_bf16_copy: param is not managed by this optimizer")
        if (target.device.type != "cpu" or target.dtype != torch.bfloat16 or not target.is_contiguous()
                or target.shape != param.shape):
            raise InvalidArgumentError(
                f"attach_bf16_copy: target must be a contiguous CPU bfloat16 tensor of shape {tuple(param.shape)} "
                f"(got {target.dtype} {tuple(target.shape)} on {target.device}, contiguous={target.is_contiguous()})")
        self._copy_out[id(param)] = (param, target)

    @staticmethod
    def _check_param(p: torch.Tensor) -> None:
        if not isinstance(p, torch.Tensor):
            raise InvalidArgumentError(f"params must be tensors (got {type(p).__name__})")
        if p.device.type != "cpu":
            raise InvalidArgumentError(f"CPUAdam params must be CPU tensors (got one on {p.device})")
        if p.dtype != torch.float32:
            raise InvalidArgumentError(f"CPUAdam params must be float32 masters (got {p.dtype})")
        if p.is_sparse or not p.is_contiguous():
            raise InvalidArgumentError("CPUAdam params must be dense and contiguous")

    @staticmethod
    def _check_grad(p: torch.Tensor, g: torch.Tensor) -> None:
        if g.is_sparse:
            raise InvalidArgumentError("CPUAdam does not support sparse gradients")
        if g.device.type != "cpu":
            raise InvalidArgumentError(f"gradients must be CPU tensors (got one on {g.device})")
        if g.dtype not in (torch.float32, torch.bfloat16):
            raise InvalidArgumentError(f"gradients must be float32 or bfloat16 (got {g.dtype})")
        if g.shape != p.shape:
            raise InvalidArgumentError(f"gradient shape {tuple(g.shape)} != param shape {tuple(p.shape)}")
        if not g.is_contiguous():
            raise InvalidArgumentError("gradients must be contiguous")

    def _state_of(self, p: torch.Tensor, amsgrad: bool) -> dict:
        state = self.state[p]
        mdt = self._moments_dtype
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=mdt, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=mdt, memory_format=torch.contiguous_format)
        step = state["step"]
        if not isinstance(step, torch.Tensor) or step.dtype != torch.float32 or step.device.type != "cpu":
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        for key, dt in (("exp_avg", mdt), ("exp_avg_sq", mdt), ("max_exp_avg_sq", torch.float32)):
            t = state.get(key)
            if t is not None and (t.dtype != dt or t.device.type != "cpu" or not t.is_contiguous()):
                state[key] = t.detach().to(device="cpu", dtype=dt).contiguous()
        return state

    def _check_state(self, p: torch.Tensor) -> None:
        """State set behind our back (e.g. ``opt.state[p][...] = t``) must still have the param's shape."""
        state = self.state.get(p)
        if not state:
            return
        for key in STATE_TENSORS[:3]:
            t = state.get(key)
            if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape)):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InvalidArgumentError(f"state['{key}'] of a param of shape {tuple(p.shape)} is {got}")

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | None = None, skip_non_finite: bool = False, grads=None):
        """One Adam step over every param that has a gradient. Returns the closure's loss (or None).

        ``grads`` optionally maps params to gradients that replace ``p.grad`` for this step (torch < 2.13 does not
        let an fp32 param hold a bf16 ``.grad``; this is how bf16 gradients reach the kernel there)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = check_grad_scale(grad_scale)
        override = self._grad_overrides(grads)
        # Validate every group before touching any state (bad input changes nothing).
        check_groups(self.param_groups)
        plans = []
        bf16_moments = self._moments_dtype == torch.bfloat16
        for gi, group in enumerate(self.param_groups):
            hyper = make_hyper(group, grad_scale=scale, skip_non_finite=skip_non_finite)
            if bf16_moments and hyper.amsgrad:
                raise InvalidArgumentError(f"param_groups[{gi}]: amsgrad needs fp32 moments (this optimizer keeps "
                                           "bf16 moments)")
            live, live_grads = [], []
            for p in group["params"]:
                g = override.get(id(p), p.grad)
                if g is None:
                    continue
                self._check_param(p)
                self._check_grad(p, g)
                self._check_state(p)
                live.append(p)
                live_grads.append(g)
            plans.append((group, hyper, live, live_grads))
        applied_all = []
        engine = self.engine
        for group, hyper, live, live_grads in plans:
            if not live:
                applied_all.append(True)
                continue
            states = [self._state_of(p, hyper.amsgrad) for p in live]
            outs = []
            if self._copy_out:
                outs = [self._copy_out[id(p)][1].data_ptr() if id(p) in self._copy_out else 0 for p in live]
            applied = engine.step(
                hyper,
                [p.data_ptr() for p in live],
                [s["exp_avg"].data_ptr() for s in states],
                [s["exp_avg_sq"].data_ptr() for s in states],
                [s["max_exp_avg_sq"].data_ptr() for s in states] if hyper.amsgrad else [],
                [g.data_ptr() for g in live_grads],
                [g.dtype == torch.bfloat16 for g in live_grads],
                outs,
                [p.numel() for p in live],
                [s["step"].data_ptr() for s in states],
                [],
                [bf16_moments] * len(live) if bf16_moments else [],
            )
            applied_all.append(bool(applied))
        self.last_step_applied = applied_all
        return loss

    def _grad_overrides(self, grads) -> dict:
        if not grads:
            return {}
        if not hasattr(grads, "items"):
            raise InvalidArgumentError(f"grads must map params to gradients (got {type(grads).__name__})")
        held = {id(p) for g in self.param_groups for p in g["params"]}
        out = {}
        for k, v in grads.items():
            if id(k) not in held:
                raise InvalidArgumentError("grads has a key that is not a param of this optimizer")
            if not isinstance(v, torch.Tensor):
                raise InvalidArgumentError(f"grads values must be tensors (got {type(v).__name__})")
            out[id(k)] = v
        return out
