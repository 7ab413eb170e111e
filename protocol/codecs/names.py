"""The codec table: every wire codec's name and envelope id, and which ones a run file may name. Torch-free.

The one list of codec names: ``protocol.codecs.registry`` attaches the kernels to these rows (and refuses a row
without one), ``trainer.config`` validates a run's ``[compression]`` against ``RUN_CODECS``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CodecName:
    name: str
    id: int
    """The codec id every TensorEnvelope carries; never reused."""
    in_runs: bool
    """A run file may name it for activations, gradients and averaging (values, not deltas)."""
    use: str


CODEC_TABLE = (
    CodecName("none", 0, True, "raw bytes of the tensor's own dtype: token ids, exact transfers"),
    CodecName("fp16", 1, True, "float16, clamped to +-65504 (reference)"),
    CodecName("bf16", 2, True, "bfloat16 (reference)"),
    CodecName("int8", 3, True, "blockwise absmax, 128 values a block: activations, gradients, averaging"),
    CodecName("int4", 4, True, "blockwise absmax, 64 values a block, 16 levels: activations on slow links"),
    CodecName("topk", 5, False, "k indices + k values: deltas with error feedback (benchmarks; zeroes values)"),
    CodecName("int8q", 6, False, "hivemind's Quantile8BitQuantization (reference point for benchmarks)"),
    CodecName("int3", 7, True, "blockwise absmax, 64 values a block, 8 levels: subspace coefficients on slow links"),
    CodecName("ecq", 8, True, "steps of 0.35 RMS per 64 values, Huffman-coded: subspace coefficients on slow links"),
)
CODEC_NAMES = tuple(c.name for c in CODEC_TABLE)
"""Every codec a peer decodes."""
RUN_CODECS = tuple(c.name for c in CODEC_TABLE if c.in_runs)
"""The codecs a run file's [compression] may name (and the sync barrier's codec)."""
CODEC_ID = {c.name: c.id for c in CODEC_TABLE}
