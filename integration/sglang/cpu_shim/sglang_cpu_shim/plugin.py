"""SGLang general plugin (entry point group `sglang.srt.plugins`, name `cpu_shim`).

SGLang calls sglang.srt.plugins.load_plugins() in the launcher (before argument parsing), the
engine, every scheduler and the detokenizer process, then applies the hooks registered here.

One hook, AFTER on sglang.srt.disaggregation.utils.get_kv_class, only with SGLANG_USE_CPU_ENGINE=1:
- a sender class whose `supports_host_tensor_indices` is True makes the prefill scheduler copy page
  indices into a pinned host tensor and record a torch.cuda.Event(), which fails on a CPU-only
  machine. With it False the sender gets plain numpy page indices.
- SGLang's own NIXL backend (`--disaggregation-transfer-backend nixl`) registers and describes its
  KV buffers as NIXL memory kind VRAM, and NIXL refuses host memory so described (NIXL_ERR_BACKEND at
  registration). On a CPU engine every buffer is host memory, so its agent is told DRAM instead: the
  backend then runs unchanged otherwise (the SGLang timing bench's like-for-like NIXL baseline).
"""
import logging
import os

logger = logging.getLogger(__name__)


def _after_get_kv_class(result, *args, **kwargs):
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1" or not isinstance(result, type):
        return result
    if getattr(result, "supports_host_tensor_indices", False):
        result.supports_host_tensor_indices = False
        logger.info("cpu_shim: %s.supports_host_tensor_indices=False", result.__name__)
    if result.__module__.startswith("sglang.srt.disaggregation.nixl."):
        _host_memory_for_sglang_nixl()
    return result


_MEM_KIND_METHODS = ("register_memory", "prep_xfer_dlist", "get_xfer_descs", "get_reg_descs")


def _host_memory_for_sglang_nixl():
    """Make NIXL agents describe memory kind VRAM as DRAM (a CPU engine's KV buffers are host memory)."""
    import nixl._api as nixl_api

    cls = nixl_api.nixl_agent
    if getattr(cls, "_cpu_shim_dram", False):
        return
    for name in _MEM_KIND_METHODS:
        def as_dram(self, *args, _method=getattr(cls, name), **kwargs):
            args = tuple("DRAM" if isinstance(a, str) and a == "VRAM" else a for a in args)
            if kwargs.get("mem_type") == "VRAM":
                kwargs["mem_type"] = "DRAM"
            return _method(self, *args, **kwargs)

        setattr(cls, name, as_dram)
    cls._cpu_shim_dram = True
    logger.info("cpu_shim: SGLang's NIXL backend registers its buffers as DRAM")


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", _after_get_kv_class, HookType.AFTER
    )
