"""k3lab: a workbook for the fused kernels of the Kimi-K3 batch-1 decode step."""

__version__ = "0.1.0"


def preload(modules, env: str | None = None, calls=()) -> None:
    """Import ``modules`` as a notebook kernel starts (``k3lab.kernelenv.PRELOAD``), then call each
    ``"module:function"`` of ``calls`` (``k3lab.kernelenv.PRELOAD_CALLS``), where ``env`` (when
    given) is set in its environment; one that fails is left for the notebook's own import to
    raise."""
    import importlib
    import os

    if env is not None and not os.environ.get(env):
        return
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the notebook's cell reports it
            continue
    for call in calls:
        module, _, function = call.partition(":")
        try:
            getattr(importlib.import_module(module), function)()
        except Exception:  # noqa: BLE001 - a head start only
            continue
