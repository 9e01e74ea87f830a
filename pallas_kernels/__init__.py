"""Pallas kernels for jaxrunner: through the Triton lowering (interpret mode on CPU), and Mosaic GPU
(`quantized_matmul`, `mosaic_attention`; Hopper only, simulated on the CPU by Mosaic GPU's interpreter
where it can)."""

from pallas_kernels.attention_kernel import KernelConfig
from pallas_kernels.common import FP8
from pallas_kernels.kv_write import write_kv
from pallas_kernels.mosaic_attention import MosaicConfig, mosaic_prefill_attention
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_decode,
    reference_ragged_paged_attention,
)
from pallas_kernels.sampler_tally import tally_kernel, tally_reference

__all__ = [
    "FP8",
    "KernelConfig",
    "MosaicConfig",
    "mosaic_prefill_attention",
    "ragged_paged_attention",
    "ragged_paged_attention_decode",
    "reference_ragged_paged_attention",
    "tally_kernel",
    "tally_reference",
    "write_kv",
]
