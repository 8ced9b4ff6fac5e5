"""refit.Host: one trainer rank of a training process, over refit's C ABI (ctypes).

    import refit
    h = refit.Host("recipe.yaml")
    h.register_rank(rank, world)
    h.register_module(model)                  # or register_tensor(name, tensor) per parameter
    h.connect()
    for version in range(1, steps + 1):
        train_step(model)                     # in place: the registered memory is read by publish
        h.publish(version)                    # collective: every rank calls it
        samples = h.generate([prompt_ids], n=4, max_tokens=32)

Tensors are read in place (zero copy): torch tensors on CPU (and CUDA where the library was
built with it), FSDP2 DTensors through to_local() and their placements (Shard(0) or
Replicate). They must stay at the same address and size from registration until the last
publish; publish() checks every registered tensor first and raises InvalidArgument naming one
that moved or was resized. They must not change while a publish runs.
"""
import ctypes

from . import _lib
from .errors import InvalidArgument, error_from

SHARD0 = "shard0"
REPLICATED = "replicated"

_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


def fsdp_chunk(n, world, rank):
    """FSDP2's Shard(0) rows of `rank`: c = ceil(n / world), [r*c, min(n, (r+1)*c)) -> (begin, count)."""
    c = -(-n // world)
    begin = min(n, rank * c)
    return begin, min(n, begin + c) - begin


def _raise(st):
    raise error_from(st.code.decode(), st.where.decode(), st.message.decode(), st.text.decode())


def _call(fn, *args):
    st = _lib.Status()
    if fn(*args, ctypes.byref(st)) != 0:
        _raise(st)


class Publication:
    """A committed publication (what every rank's publish returned)."""

    def __init__(self, c, receipts):
        self.publication_id = c.publication_id.decode()
        self.model_version = c.model_version
        self.manifest_fingerprint = c.manifest_fingerprint.decode()
        self.tensors = c.tensors
        self.bytes = c.bytes
        self.chunks = c.chunks
        self.trainer_ranks = c.trainer_ranks
        self.tp = c.tp
        self.attempts = c.attempts
        self.seconds = c.seconds
        self.peak_buffer_bytes = c.peak_buffer_bytes
        self.receipts = receipts  # per TP worker: [(resident tensor name, digest hex)]

    def __repr__(self):
        return "Publication(version=%d, tensors=%d, bytes=%d, chunks=%d, seconds=%.4f)" % (
            self.model_version, self.tensors, self.bytes, self.chunks, self.seconds)


class Sample:
    """One generated sample: token ids, their log-probabilities (under the processed sampling
    distribution), finish reason ("stop" / "length") and the model version that produced it."""

    def __init__(self, prompt_index, prompt_token_ids, token_ids, logprobs, finish_reason,
                 prompt_truncated, model_version):
        self.prompt_index = prompt_index
        self.prompt_token_ids = prompt_token_ids
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.prompt_truncated = prompt_truncated
        self.model_version = model_version

    def __repr__(self):
        return "Sample(prompt=%d, tokens=%s, finish=%s, version=%d)" % (
            self.prompt_index, self.token_ids, self.finish_reason, self.model_version)


class RolloutStatus:
    def __init__(self, c):
        self.committed_version = c.committed_version
        self.connection = c.connection.decode()
        self.needs_publication = bool(c.needs_publication)
        self.sleep_level = c.sleep_level
        self.weights_awake = bool(c.weights_awake)
        self.kv_cache_awake = bool(c.kv_cache_awake)
        self.publishing = bool(c.publishing)
        self.epoch = c.epoch
        self.complete = bool(c.complete)
        self.last_error = c.last_error.decode()


def _is_dtensor(t):
    return hasattr(t, "placements") and hasattr(t, "to_local") and hasattr(t, "device_mesh")


class _Registered:
    __slots__ = ("obj", "local", "data", "nbytes")

    def __init__(self, obj, local, data, nbytes):
        self.obj = obj      # what the caller registered (keeps the memory alive)
        self.local = local  # () -> the local torch tensor now
        self.data = data
        self.nbytes = nbytes


class Host:
    """One trainer rank (see the module documentation)."""

    def __init__(self, config, coordinator_host=None, coordinator_port=None,
                 runtime_executable=None):
        lib = _lib.lib()
        o = _lib.HostOptions()
        o.config_path = str(config).encode()
        o.coordinator_host = coordinator_host.encode() if coordinator_host else None
        o.coordinator_port = -1 if coordinator_port is None else int(coordinator_port)
        o.runtime_executable = runtime_executable.encode() if runtime_executable else None
        handle = ctypes.c_void_p()
        _call(lib.refit_host_create, ctypes.byref(o), ctypes.byref(handle))
        self._lib = lib
        self._h = handle
        self._tensors = {}
        self._rank = None
        self._world = None

    # -- lifecycle ---------------------------------------------------------------------
    def close(self):
        """Leaves the deployment and frees the host (also on garbage collection)."""
        if getattr(self, "_h", None):
            self._lib.refit_host_destroy(self._h)
            self._h = None

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _handle(self):
        if not self._h:
            raise error_from("invalid_state", "host", "this host was closed")
        return self._h

    @property
    def rank(self):
        return self._lib.refit_host_rank(self._handle())

    @property
    def world(self):
        return self._lib.refit_host_world(self._handle())

    @property
    def connected(self):
        return bool(self._lib.refit_host_connected(self._handle()))

    # -- registration ------------------------------------------------------------------
    def register_rank(self, rank, world=0, device=""):
        _call(self._lib.refit_host_register_rank, self._handle(), rank, world, device.encode())
        self._rank, self._world = rank, self.world

    def register_synthetic(self, start_step=0):
        """refit's synthetic weights instead of the trainer's own (tests, benchmarks)."""
        _call(self._lib.refit_host_register_synthetic, self._handle(), start_step)

    def model_tensors(self):
        """The model's canonical key stream: [(name, shape, dtype)]."""
        count = _lib.u64()
        _call(self._lib.refit_host_model_tensor_count, self._handle(), ctypes.byref(count))
        out = []
        for i in range(count.value):
            name = ctypes.create_string_buffer(512)
            dtype = ctypes.create_string_buffer(32)
            shape = (_lib.i64 * 8)()
            ndim = _lib.u32()
            _call(self._lib.refit_host_model_tensor, self._handle(), i, name, 512, dtype, 32, shape,
                  ctypes.byref(ndim))
            out.append((name.value.decode(), tuple(shape[:ndim.value]), dtype.value.decode()))
        return out

    def register_tensor(self, name, tensor, placement=None, global_shape=None):
        """Registers one parameter's local shard of this rank.

        `tensor`: an FSDP2 DTensor (placement and global shape from it: Shard(0) or Replicate)
        or a torch tensor: with placement=None or "replicated" it is the whole tensor; with
        "shard0" it holds this rank's FSDP2 rows of `global_shape`."""
        if self._rank is None:
            raise error_from("invalid_state", name, "register_rank first")
        if _is_dtensor(tensor):
            placements = tuple(tensor.placements)
            if len(placements) != 1:
                raise InvalidArgument("invalid_argument", name,
                                      "a DTensor over a %d-d device mesh; refit takes 1-d meshes "
                                      "(FSDP2 fully_shard)" % len(placements))
            p = placements[0]
            if p.is_shard() and getattr(p, "dim", None) == 0:
                placement = SHARD0
            elif p.is_replicate():
                placement = REPLICATED
            else:
                raise InvalidArgument("invalid_argument", name,
                                      "placement %r is neither Shard(0) nor Replicate()" % (p,))
            global_shape = tuple(tensor.shape)
            obj = tensor
            local_of = lambda: obj.to_local()  # noqa: E731
        else:
            obj = tensor
            local_of = lambda: obj  # noqa: E731
            if placement is None:
                placement = REPLICATED
            if placement not in (SHARD0, REPLICATED):
                raise InvalidArgument("invalid_argument", name,
                                      "placement %r is neither 'shard0' nor 'replicated'" % (placement,))
            if global_shape is None:
                if placement == SHARD0:
                    raise InvalidArgument("invalid_argument", name,
                                          "a Shard(0) torch tensor needs global_shape")
                global_shape = tuple(tensor.shape)
        local = local_of()
        kind = local.device.type
        if kind not in ("cpu", "cuda"):
            raise InvalidArgument("invalid_argument", name,
                                  "is on device %s; refit reads CPU or CUDA memory" % local.device)
        if not local.is_contiguous():
            raise InvalidArgument("invalid_argument", name,
                                  "is not contiguous (shape %s, strides %s): refit reads the memory "
                                  "in place; register a contiguous tensor"
                                  % (tuple(local.shape), tuple(local.stride())))
        dtype = _DTYPES.get(str(local.dtype))
        if dtype is None:
            raise InvalidArgument("invalid_argument", name,
                                  "dtype %s is not bfloat16, float16 or float32" % local.dtype)
        device = "cpu" if kind == "cpu" else "cuda:%d" % local.device.index
        n = int(global_shape[0]) if len(global_shape) else 1
        if placement == SHARD0:
            begin, _ = fsdp_chunk(n, self._world, self._rank)
            rows = int(local.shape[0]) if local.dim() else 1
        else:
            begin, rows = 0, (int(local.shape[0]) if local.dim() else 1)
        nbytes = local.numel() * local.element_size()
        shape = (_lib.i64 * max(1, len(global_shape)))(*[int(d) for d in global_shape])
        d = _lib.TensorDesc()
        d.name = name.encode()
        d.data = local.data_ptr() if nbytes else None
        d.bytes = nbytes
        d.dtype = dtype.encode()
        d.device = device.encode()
        d.global_shape = shape
        d.ndim = len(global_shape)
        d.placement = 0 if placement == SHARD0 else 1
        d.row_begin = begin
        d.rows = rows
        _call(self._lib.refit_host_register_tensor, self._handle(), ctypes.byref(d))
        self._tensors[name] = _Registered(obj, local_of, d.data, nbytes)

    def register_module(self, module, name_map=None):
        """Registers every tensor of an nn.Module (its parameters and persistent buffers, as the
        tensors themselves) or of a state_dict. `name_map` maps the trainer's names to canonical
        HF names: a dict (unlisted names are kept) or a callable; a name mapped to None is skipped.
        Two names mapped to one canonical name are refused, naming both."""
        if hasattr(module, "state_dict") and callable(module.state_dict):
            items = module.state_dict(keep_vars=True).items()
        else:
            items = dict(module).items()
        chosen = {}
        for key, tensor in items:
            if callable(name_map):
                name = name_map(key)
            elif name_map is not None:
                name = name_map.get(key, key)
            else:
                name = key
            if name is None:
                continue
            if name in chosen:
                raise InvalidArgument("invalid_argument", name,
                                      "both %s and %s map to %s" % (chosen[name][0], key, name))
            chosen[name] = (key, tensor)
        for name, (key, tensor) in chosen.items():
            self.register_tensor(name, tensor)

    def check_tensors(self):
        """Raises InvalidArgument naming the first registered tensor whose memory moved or was
        resized since registration (publish does this first)."""
        for name, reg in self._tensors.items():
            local = reg.local()
            nbytes = local.numel() * local.element_size()
            data = local.data_ptr() if nbytes else None
            _call(self._lib.refit_host_check_tensor, self._handle(), name.encode(), data, nbytes)

    # -- publication -------------------------------------------------------------------
    def connect(self):
        _call(self._lib.refit_host_connect, self._handle())

    def step(self):
        """Counts an optimizer step (synthetic weights: applies one); returns the step number."""
        out = _lib.u64()
        _call(self._lib.refit_host_step, self._handle(), ctypes.byref(out))
        return out.value

    def publish(self, model_version):
        """This rank's share of the collective publish; returns the committed Publication or
        raises the typed error every rank got (RankLost, PublicationFailed, ...)."""
        self.check_tensors()
        if any(reg.local().device.type == "cuda" for reg in self._tensors.values()):
            import torch
            torch.cuda.synchronize()  # the trainer's kernels wrote the memory refit reads
        p = _lib.Publication()
        _call(self._lib.refit_host_publish, self._handle(), model_version, ctypes.byref(p))
        receipts = []
        for t in range(p.receipts):
            count = _lib.u64()
            _call(self._lib.refit_host_receipt_checksum_count, self._handle(), t, ctypes.byref(count))
            sums = []
            for i in range(count.value):
                name = ctypes.create_string_buffer(512)
                digest = ctypes.create_string_buffer(32)
                _call(self._lib.refit_host_receipt_checksum, self._handle(), t, i, name, 512, digest, 32)
                sums.append((name.value.decode(), digest.value.decode()))
            receipts.append(sums)
        return Publication(p, receipts)

    # -- rollout -----------------------------------------------------------------------
    def generate(self, prompts, n=1, max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, seed=0,
                 stop_token_ids=(), max_prompt_length=0):
        """Generates from `prompts` (each a list of token ids, or a str: its UTF-8 bytes, the
        byte tokenizer's ids); returns [Sample]. Raises PublicationOpen during a publication."""
        ids = []
        for p in prompts:
            ids.append(list(p.encode("utf-8")) if isinstance(p, str) else [int(t) for t in p])
        flat = [t for p in ids for t in p]
        tokens = (_lib.i32 * max(1, len(flat)))(*flat)
        lengths = (_lib.u64 * max(1, len(ids)))(*[len(p) for p in ids])
        stops = (_lib.i32 * max(1, len(stop_token_ids)))(*stop_token_ids)
        sp = _lib.SamplingParams(n, max_tokens, temperature, top_k, top_p, seed, stops,
                                 len(stop_token_ids), max_prompt_length)
        count, version = _lib.u64(), _lib.u64()
        _call(self._lib.refit_host_generate, self._handle(), tokens, lengths, len(ids),
              ctypes.byref(sp), ctypes.byref(count), ctypes.byref(version))
        out = []
        for i in range(count.value):
            info = _lib.SampleInfo()
            _call(self._lib.refit_host_sample, self._handle(), i, ctypes.byref(info), None, None, 0,
                  None, 0)
            toks = (_lib.i32 * max(1, info.token_count))()
            lps = (ctypes.c_float * max(1, info.token_count))()
            prompt = (_lib.i32 * max(1, info.prompt_token_count))()
            _call(self._lib.refit_host_sample, self._handle(), i, ctypes.byref(info), toks, lps,
                  info.token_count, prompt, info.prompt_token_count)
            out.append(Sample(info.prompt_index, list(prompt[:info.prompt_token_count]),
                              list(toks[:info.token_count]), list(lps[:info.token_count]),
                              info.finish_reason.decode(), bool(info.prompt_truncated),
                              info.model_version))
        return out

    def sleep(self, level=1):
        s = _lib.RolloutStatus()
        _call(self._lib.refit_host_sleep, self._handle(), level, ctypes.byref(s))
        return RolloutStatus(s)

    def wake(self, weights=True, kv_cache=True):
        s = _lib.RolloutStatus()
        _call(self._lib.refit_host_wake, self._handle(), int(weights), int(kv_cache), ctypes.byref(s))
        return RolloutStatus(s)

    def status(self):
        s = _lib.RolloutStatus()
        _call(self._lib.refit_host_status, self._handle(), ctypes.byref(s))
        return RolloutStatus(s)
