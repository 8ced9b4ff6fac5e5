"""refit: publish a PyTorch trainer's own weights (FSDP2 shards, CPU and GPU tensors) into
refit's tensor-parallel rollout runtime, and generate from it. A ctypes layer over librefit.so
(refit/refit.h): no compilation against Python or torch."""
from .errors import (Asleep, BarrierTimeout, Busy, CoordinatorLost, CoordinatorUnreachable,
                     InvalidArgument, InvalidState, JoinRefused, NeedsPublication,
                     ProtocolMismatch, PublicationFailed, PublicationOpen, RankLost, RefitError,
                     RuntimeFailure, Unauthorized, VerificationFailed)
from .host import REPLICATED, SHARD0, Host, Publication, RolloutStatus, Sample, fsdp_chunk

__all__ = [
    "Host", "Publication", "Sample", "RolloutStatus", "SHARD0", "REPLICATED", "fsdp_chunk",
    "RefitError", "InvalidArgument", "InvalidState", "RankLost", "CoordinatorLost",
    "CoordinatorUnreachable", "PublicationFailed", "VerificationFailed", "BarrierTimeout",
    "PublicationOpen", "Asleep", "NeedsPublication", "Busy", "Unauthorized", "JoinRefused",
    "ProtocolMismatch", "RuntimeFailure", "version",
]


def version():
    """librefit's version string."""
    from . import _lib
    return _lib.lib().refit_version().decode()
