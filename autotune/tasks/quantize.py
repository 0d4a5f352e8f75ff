"""QLoRA's base (issue 33, item 3): an ``hf:`` model's linear layers in 4-bit NF4, as bitsandbytes holds them.

``--quantize nf4`` (``hf:PATH?quantize=nf4``, with ``--lora-rank``) builds the model as transformers'
``from_pretrained`` does with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_compute_dtype=torch.bfloat16)`` (the QLoRA recipe of the PEFT and TRL docs):

- transformers' own ``replace_with_bnb_linear`` swaps every ``nn.Linear`` but the ones its quantizer keeps
  (``get_keys_to_not_convert``: the output embedding, the tied weights, the last module) for
  ``bitsandbytes.nn.Linear4bit``; each weight is quantized by ``bitsandbytes.functional.quantize_4bit``
  into a ``Params4bit`` (packed uint8, two weights a byte, and an fp32 absmax per 64 weights) and the
  module's ``quant_state``, as transformers' ``Bnb4bitQuantize`` loads a checkpoint's weight;
- ``--quantize nf4-dq`` adds ``bnb_4bit_use_double_quant=True`` (the QLoRA paper's): the absmax itself 8-bit;
- ``model.is_loaded_in_4bit`` is set as ``from_pretrained`` sets it, then peft's
  ``prepare_model_for_kbit_training(use_gradient_checkpointing=False)`` runs as the field's recipes run it:
  the base frozen and every bf16/fp16 parameter that is not 4-bit (embeddings, norms, the LM head) cast to
  fp32. Checkpointing is the probe's ``--ac`` policy, not peft's;
- LoRA (autotune/tasks/hf.py) wraps that, so peft's 4-bit LoRA layer (``peft.tuners.lora.bnb.Linear4bit``)
  holds each adapted module.

On ``meta`` (the task's name, the fingerprint, the probe's build before it materializes the model) the
quantization runs through bitsandbytes' own meta kernels: the packed weight and the absmax have their real
shapes and dtypes, no memory. The probe materializes a meta model by giving each parameter storage
(autotune/measure/trial.py), which a ``Params4bit`` and its ``quant_state`` do not survive; so each 4-bit
module carries a ``reset_parameters`` of its own (the probe calls every module's after materializing) that
quantizes a freshly initialised weight of its shape on the device where its storage now is, one module at a
time, with bitsandbytes' own quantizer: the module ends as transformers leaves it, the packed weight,
absmax and NF4 code made by the kernels that make them in a real run.

Importing this module imports neither torch nor bitsandbytes; :func:`quantize_model` imports both.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.core.errors import TaskError

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "QUANTIZATIONS",
    "Quantization",
    "fake_kernel_note",
    "quantization_of",
    "quantize_model",
    "require_bitsandbytes",
]


@dataclass(frozen=True)
class Quantization:
    """One ``--quantize`` choice: what transformers' ``BitsAndBytesConfig`` would say."""

    name: str
    quant_type: str  # bnb_4bit_quant_type
    double_quant: bool  # bnb_4bit_use_double_quant
    compute_dtype: str  # bnb_4bit_compute_dtype
    blocksize: int = 64  # bitsandbytes' default, which transformers does not change


QUANTIZATIONS = {
    # BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16):
    # double quantization off, transformers' default.
    "nf4": Quantization("nf4", quant_type="nf4", double_quant=False, compute_dtype="bf16"),
    # ... with bnb_4bit_use_double_quant=True (the QLoRA paper's): the absmax itself 8-bit, blocks of 256.
    "nf4-dq": Quantization("nf4-dq", quant_type="nf4", double_quant=True, compute_dtype="bf16"),
}


def quantization_of(name: str) -> Quantization:
    """The quantization ``--quantize NAME`` names.

    Raises:
        TaskError: no such quantization (one line naming the flag and the choices).
    """
    found = QUANTIZATIONS.get(name)
    if found is None:
        raise TaskError(f"--quantize {name!r}: one of {', '.join(QUANTIZATIONS)} (4-bit NF4 as bitsandbytes holds it)")
    return found


def fake_kernel_note(name: str, device_kind: str) -> str:
    """What an estimate (fake trials) of a 4-bit base leaves out, for its datasheet's warnings: bitsandbytes'
    fake kernels allocate each op's outputs only, and its real kernels take one layer's scratch beside them."""
    if device_kind == "cuda":
        return (
            f"--quantize {name}: the fake trials ran bitsandbytes' fake kernels, which allocate each op's output "
            "only; the figure adds, as gemm_4bit's kernel temporary, the weight it dequantizes to bf16 (out x in x 2 "
            "bytes, one layer at a time) where bitsandbytes 0.50's CUDA backend does (past 1536 tokens per "
            "micro-batch, or where its heuristic for the card picks that path), and nothing for its fused kernel"
        )
    return (
        f"--quantize {name}: the fake trials ran bitsandbytes' fake kernels, which allocate each 4-bit op's output "
        "only; its CPU dequantization also makes int32 and fp32 copies of one layer's weight (freed inside the op), "
        "which this figure leaves out and real trials (autotune probe) count"
    )


def require_bitsandbytes(name: str) -> None:
    """Refuse, in one line, a quantization the installed libraries cannot provide.

    Raises:
        TaskError: bitsandbytes (or transformers' integration of it) is not installed.
    """
    try:
        import bitsandbytes  # noqa: F401
        from transformers.integrations import bitsandbytes as _  # noqa: F401
    except ImportError:
        raise TaskError(f"--quantize {name} needs bitsandbytes: pip install 'autotune[hf]'") from None


def quantize_model(model: nn.Module, name: str) -> nn.Module:
    """The model with its linear layers in 4-bit as transformers' ``from_pretrained`` holds them under
    ``BitsAndBytesConfig`` (the module docstring says each step), prepared by peft for k-bit training.

    Args:
        model: a transformers model, on ``meta`` or on a device (its weights are quantized where they are).
        name: a key of :data:`QUANTIZATIONS`.

    Returns:
        The same model object, changed in place.

    Raises:
        TaskError: an unknown quantization, bitsandbytes missing, or a model with no linear layer to quantize.
    """
    import torch
    from bitsandbytes.nn import Linear4bit
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    quantization = quantization_of(name)
    require_bitsandbytes(name)
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quantization.quant_type,
        bnb_4bit_use_double_quant=quantization.double_quant,
        bnb_4bit_compute_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[quantization.compute_dtype],
    )
    if quantization.double_quant:
        _seed_dynamic_map()
    originals = {module_name: module for module_name, module in model.named_modules()}
    replace_with_bnb_linear(model, modules_to_not_convert=get_keys_to_not_convert(model), quantization_config=config)
    quantized = 0
    for module_name, module in model.named_modules():
        if not isinstance(module, Linear4bit):
            continue
        original = originals[module_name]
        weight = original.weight.detach()
        if getattr(module, "source_cls", None) is not torch.nn.Linear:  # transformers' Conv1D keeps it (in, out)
            weight = weight.t()
        _install(
            module,
            weight,
            blocksize=quantization.blocksize,
            double_quant=quantization.double_quant,
            quant_type=quantization.quant_type,
        )
        if original.bias is not None:
            module.bias = original.bias
        module.requires_grad_(False)
        # Called by the probe after it gives a meta model storage (the module docstring says why).
        module.reset_parameters = _Requantize(weakref.ref(module))  # type: ignore[method-assign]
        quantized += 1
    if not quantized:
        raise TaskError(f"--quantize {name}: the model has no linear layer bitsandbytes would quantize")
    del originals
    model.is_loaded_in_4bit = True  # type: ignore[assignment]  # what from_pretrained sets; peft reads it
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False, auto_clear_cache=False)  # type: ignore[no-any-return]


def _seed_dynamic_map() -> None:
    """bitsandbytes caches the 8-bit map that double quantization codes the absmax with on the device of its
    first use (``functional.name2qmap``) and copies it to each later one: first used on ``meta`` (the task's
    build for its name), the cache could not be copied anywhere. A real map on the CPU, made once, serves
    every device as a real run's does (its copy into each quant state is that state's)."""
    import torch
    from bitsandbytes import functional

    cached = functional.name2qmap.get("dynamic")
    if cached is None or cached.device.type == "meta":
        with torch.device("cpu"):
            functional.name2qmap["dynamic"] = functional.create_dynamic_map()


def _install(module: Any, weight: Any, *, blocksize: int, double_quant: bool, quant_type: str) -> None:
    """Quantize weight (out, in) into module's ``Params4bit`` and ``quant_state`` as bitsandbytes'
    ``Params4bit._quantize`` does (transformers' loader reaches it through ``.to(device)``), on ``meta``
    too, where ``.to`` leaves a weight unquantized. Under torch's default dtype fp32, as transformers
    loads: bitsandbytes makes the NF4 code in the default dtype, which a bf16 task's factory has set."""
    import torch
    from bitsandbytes.functional import quantize_4bit
    from bitsandbytes.nn import Params4bit
    from torch._subclasses.fake_tensor import FakeTensor

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        packed, state = quantize_4bit(
            weight.contiguous(),
            blocksize=blocksize,
            compress_statistics=double_quant,
            quant_type=quant_type,
            quant_storage=module.quant_storage,
        )
    finally:
        torch.set_default_dtype(previous)
    held = {
        "quant_state": state,
        "blocksize": blocksize,
        "compress_statistics": double_quant,
        "quant_type": quant_type,
        "quant_storage": module.quant_storage,
        "module": module,
        "bnb_quantized": True,
    }
    if isinstance(packed, FakeTensor):
        # A fake trial's tensors are FakeTensors, which no other tensor subclass can wrap (Params4bit's
        # _make_subclass refuses them): the packed weight is a Parameter carrying Params4bit's attributes,
        # which is all Linear4bit's forward and bitsandbytes' matmul_4bit read of it. The same storage.
        weight_param = torch.nn.Parameter(packed, requires_grad=False)
        for key, value in held.items():
            setattr(weight_param, key, value)
        module.weight = weight_param
    else:
        module.weight = Params4bit(packed, requires_grad=False, **held)
    module.quant_state = state


@dataclass(frozen=True)
class _Requantize:
    """A 4-bit module's ``reset_parameters``: a fresh weight of its shape and dtype, initialised as the
    probe initialises weights (a small normal: finite values), quantized where the module's storage is."""

    module: weakref.ReferenceType[Any]

    def __call__(self) -> None:
        import torch

        module = self.module()
        if module is None:
            return
        state: Any = module.quant_state
        device = module.weight.device
        held: Any = getattr(module.weight, "quant_state", None)
        if device.type == "meta" or (held is state and state.absmax.device == device):
            return  # quantized where it lives already (built on the device, not materialized)
        # The materialized packed storage goes first: one module's fresh weight is all that is alive beside it.
        module._parameters["weight"] = None
        weight = torch.empty(tuple(state.shape), dtype=state.dtype, device=device)
        with torch.no_grad():
            weight.normal_(0.0, 0.02)
        _install(module, weight, blocksize=state.blocksize, double_quant=state.nested, quant_type=state.quant_type)
