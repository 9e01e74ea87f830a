"""What a runner's programs depend on (`Context`): the model, the runner's configuration, the
kernels, the dtype, and the choices between program variants that a step's plan and the warm-up
examples both make through it. Hashable, so runners of equal contexts share their programs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxrunner.config import Kernels, ModelConfig, RunnerConfig
from jaxrunner.lora.slots import lora_structs
from jaxrunner.models.llama import MODEL_AXIS, param_specs, param_structs
from jaxrunner.runner.input_batch import bucket, build_inputs
from jaxrunner.runner.parallel import place
from jaxrunner.runner.request_table import RequestTable
from jaxrunner.runner.state import init_state, state_specs
from jaxrunner.runner.step import SampleInputs, TokenInputs
from jaxrunner.sampling import SamplerFlags, flag_variants, neutral_metadata
from jaxrunner.spec_decode.drafts import queries_per_decode

KV_TRANSFER_BYTES = 64 << 20  # the most one host-tier copy moves: copies this large run at the link's rate
LOADS_IN_FLIGHT_BYTES = 2 << 30  # a host tier's device bytes (each device's share) of the blocks loading at once
PIECE_GROUPS = (1, 2, 4, 8)  # how many of the largest pieces one program gathers from or writes into the cache


@dataclass(frozen=True)
class Context:
    """What a runner's programs depend on, and the choices between them."""

    model: ModelConfig
    config: RunnerConfig
    kernels: Kernels
    dtype: str
    draft_model: ModelConfig | None = None  # speculative decoding with a draft model
    mesh: Mesh | None = None  # tensor parallelism: the devices the params and the cache are split over

    @functools.cached_property
    def params(self) -> dict:
        """The params' shapes and dtype (every weight is in the runner's dtype), and shardings."""
        structs = param_structs(self.model, self.dtype)
        return structs if self.mesh is None else place(structs, param_specs(self.model), self.mesh)

    @functools.cached_property
    def draft_params(self) -> dict:
        return param_structs(self.draft_model, self.dtype) if self.draft_model is not None else {}

    @functools.cached_property
    def lora(self) -> tuple:
        """The LoRA slots' shapes (() without LoRA)."""
        return lora_structs(self.model, self.config.lora, self.dtype)

    @functools.cached_property
    def adapter(self) -> tuple:
        """One slot's tensors: what `write_slot` writes."""
        return lora_structs(self.model, dataclasses.replace(self.config.lora, max_loras=1), self.dtype)

    @functools.cached_property
    def state(self):
        state = jax.eval_shape(functools.partial(init_state, self.model, self.config, self.draft_model))
        return state if self.mesh is None else place(state, state_specs(state), self.mesh)

    @property
    def spec_tokens(self) -> int:
        """Drafts per request per step (0: no speculative decoding)."""
        return self.config.speculative.num_speculative_tokens

    @property
    def queries_per_decode(self) -> int:
        return queries_per_decode(self.config.speculative)

    @functools.cached_property
    def sampler_variants(self) -> tuple[SamplerFlags, ...]:
        return flag_variants(self.config.sampler, self.model.vocab_size)

    @property
    def decode_form(self) -> bool:
        """Whether the backbone has a decode form: only the Pallas kernels have a decode kernel, and
        batch-invariant steps do without it (a decode then runs the kernel that a mixed batch runs,
        and its KV splits would follow the batch's size)."""
        return self.kernels.pallas and not self.kernels.batch_invariant

    def uniform_decode(self, num_scheduled: dict[str, int]) -> bool:
        """Whether a batch runs the backbone's decode form: there is one, and every sequence has at most
        1 + k query tokens (one, without speculative decoding)."""
        return self.decode_form and all(n <= self.queries_per_decode for n in num_scheduled.values())

    def forward_forms(self, t_bucket: int) -> list[bool]:
        """The backbone forms of a token bucket: general, and decode where a decode batch can land
        (it has at most max_num_seqs * (1 + k) tokens)."""
        largest = min(self.config.max_num_seqs * self.queries_per_decode, self.config.max_num_batched_tokens)
        return [False] + [True] * (self.decode_form and t_bucket <= bucket(largest, self.config.token_buckets))

    def loops(self, flags: SamplerFlags) -> bool:
        """Whether a multi-step decode with these flags runs as one device call: plain sampling
        (temperature, seeds, logprobs). Other batches run its rounds through the single-step programs."""
        return flags in self.sampler_variants[:2]

    def tokens(self, t_bucket: int) -> TokenInputs:
        """Padding inputs of a token bucket: the shapes of every real batch in that bucket."""
        empty = RequestTable.empty(self.config.max_num_seqs)
        return build_inputs(empty, [], {}, self.config, self.model.vocab_size, t_bucket, 1)[0]

    def samples(self, b_bucket: int, flags: SamplerFlags) -> SampleInputs:
        nowhere = np.full(b_bucket, self.config.max_num_seqs, np.int32)
        md = neutral_metadata(b_bucket, self.config.sampler, self.model.vocab_size, flags, self.queries_per_decode)
        return SampleInputs(nowhere, np.zeros(b_bucket, np.int32), md, np.zeros(b_bucket, bool), np.zeros(b_bucket, np.int32))

    @property
    def kv_transfer_buckets(self) -> tuple[int, ...]:
        """Block counts a host tier copies in one piece, powers of two (none without a host tier):
        the most that fit KV_TRANSFER_BYTES, or one block where a block is larger."""
        if not self.config.num_host_blocks:
            return ()
        most = min(max(1, KV_TRANSFER_BYTES // self.packed_blocks(1).size), self.config.num_blocks)
        return tuple(1 << i for i in range(most.bit_length()))

    def packed_blocks(self, n: int) -> jax.ShapeDtypeStruct:
        """`n` blocks as a host tier keeps them (`step.gather_blocks`), on the device: bytes [n,
        shards, bytes], each device's heads in its own row."""
        leaves = jax.tree.leaves((self.state.kv, self.state.draft_kv))
        size = sum(leaf.size // leaf.shape[0] * leaf.dtype.itemsize for leaf in leaves) // self.model.shards
        sharding = (NamedSharding(self.mesh, P(None, MODEL_AXIS, None)) if self.mesh is not None
                    else SingleDeviceSharding(jax.devices()[0]))
        return jax.ShapeDtypeStruct((n, self.model.shards, size), np.uint8, sharding=sharding)

    def hidden(self, rows: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((rows, self.model.hidden_size), self.dtype)

    def last_hidden(self) -> jax.ShapeDtypeStruct:
        """The backbone's per-sequence hidden states: each sequence's last 1 + k tokens'."""
        return jax.ShapeDtypeStruct((self.config.max_num_seqs, self.queries_per_decode, self.model.hidden_size), self.dtype)
