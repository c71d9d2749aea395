"""SGLang general plugin (entry point group `sglang.srt.plugins`, name `cpu_shim`).

SGLang calls sglang.srt.plugins.load_plugins() in the launcher (before argument parsing), the
engine, every scheduler and the detokenizer process, then applies the hooks registered here.

One hook, AFTER on sglang.srt.disaggregation.utils.get_kv_class: a sender class whose
`supports_host_tensor_indices` is True makes the prefill scheduler copy page indices into a
pinned host tensor and record a torch.cuda.Event(), which fails on a CPU-only machine. With it
False the sender gets plain numpy page indices. Only with SGLANG_USE_CPU_ENGINE=1.
"""
import logging
import os

logger = logging.getLogger(__name__)


def _after_get_kv_class(result, *args, **kwargs):
    if (
        os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1"
        and isinstance(result, type)
        and getattr(result, "supports_host_tensor_indices", False)
    ):
        result.supports_host_tensor_indices = False
        logger.info("cpu_shim: %s.supports_host_tensor_indices=False", result.__name__)
    return result


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", _after_get_kv_class, HookType.AFTER
    )
