"""refit's typed errors: every failure of the C ABI becomes one of these, carrying refit's
error code name (`code`), where it happened (`where`: a tensor name, a config key, a rank)
and the message."""


class RefitError(Exception):
    """A failure reported by refit. str(e) is refit's text: "refit.<code> at <where>: <message>"."""

    code = None

    def __init__(self, code, where, message, text=None):
        self.code = code
        self.where = where
        self.message = message
        self.text = text or ("refit.%s%s: %s" % (code, " at " + where if where else "", message))
        super().__init__(self.text)


class InvalidArgument(RefitError, ValueError):
    """Bad input (a tensor's dtype, shape, device, rows, name; a sampling parameter; ...)."""


class InvalidState(RefitError):
    """A call in the wrong state (publish before connect, register after connect, ...)."""


class RankLost(RefitError):
    """A trainer rank's process left while a publish waited or ran: publish again once it rejoined."""


class CoordinatorLost(RefitError):
    """The coordinator went away; this host is unusable (create a new one)."""


class CoordinatorUnreachable(RefitError):
    """No coordinator answered at the configured address in time."""


class PublicationFailed(RefitError):
    """The publication failed and the runtime was poisoned (gate, manifest, verification,
    preflight, ...); nothing was committed."""


class VerificationFailed(PublicationFailed):
    """The runtime's resident bytes differ from the trainer's registered memory."""


class BarrierTimeout(RefitError):
    """Not every rank called publish(v) within serve.publish_barrier_ms."""


class PublicationOpen(RefitError):
    """generate / sleep / wake while a publication is open (code update_open)."""


class Asleep(RefitError):
    """generate while the runtime's weights or KV cache sleep."""


class NeedsPublication(RefitError):
    """generate while the runtime's weights are invalid (fresh runtime or sleep level 2)."""


class Busy(RefitError):
    """Another request or publication is in flight."""


class Unauthorized(RefitError):
    """Wrong or missing shared secret."""


class JoinRefused(RefitError):
    """The coordinator refused this rank (rank taken or out of range, another world or model)."""


class ProtocolMismatch(RefitError):
    """The coordinator speaks another refit wire protocol."""


class RuntimeFailure(RefitError):
    """The rollout runtime failed, timed out, exited, or was restarted."""


_BY_CODE = {
    "invalid_argument": InvalidArgument,
    "runtime_invalid_argument": InvalidArgument,
    "invalid_state": InvalidState,
    "rank_lost": RankLost,
    "coordinator_lost": CoordinatorLost,
    "coordinator_unreachable": CoordinatorUnreachable,
    "gate_failed": PublicationFailed,
    "manifest_mismatch": PublicationFailed,
    "preflight_failed": PublicationFailed,
    "verification_failed": VerificationFailed,
    "poisoned": PublicationFailed,
    "barrier_timeout": BarrierTimeout,
    "update_open": PublicationOpen,
    "asleep": Asleep,
    "needs_publication": NeedsPublication,
    "busy": Busy,
    "unauthorized": Unauthorized,
    "join_refused": JoinRefused,
    "protocol_mismatch": ProtocolMismatch,
    "runtime_timeout": RuntimeFailure,
    "runtime_exited": RuntimeFailure,
    "protocol_error": RuntimeFailure,
    "spawn_failed": RuntimeFailure,
    "broken": RuntimeFailure,
    "not_attached": RuntimeFailure,
    "restart_limit": RuntimeFailure,
}


def error_from(code, where, message, text=None):
    """The typed exception of refit error `code`."""
    return _BY_CODE.get(code, RefitError)(code, where, message, text)
