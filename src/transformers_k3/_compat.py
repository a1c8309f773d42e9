"""What differs between the transformers releases this package supports (5.23 to 5.25), in one place.

transformers 5.24 renamed the cache argument of ``forward``, ``generate``'s model kwargs, ``create_causal_mask`` and
the output field from ``past_key_values`` to ``cache`` (the old name warns until 5.40). K3's models take either name
and hand transformers the one it expects; drop the old name here once 5.23 leaves the supported range.
"""

from __future__ import annotations

import dataclasses
import inspect

from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import MoeModelOutputWithPast

# the name generate() uses for the cache in its model kwargs and in prepare_inputs_for_generation
CACHE_KWARG = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters \
    else "past_key_values"
# the name create_causal_mask takes it under
MASK_CACHE_KWARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
# the field of transformers' output classes that holds it
OUTPUT_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(MoeModelOutputWithPast)} \
    else "past_key_values"


def either_cache(cache, past_key_values):
    """The cache a caller passed under the new name or the old one (both at once is a mistake)."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("pass the cache once, as `cache` (or `past_key_values`, its name before transformers 5.24)")
    return cache if cache is not None else past_key_values


def output_cache(output):
    """The cache held by a transformers output, under whichever field name this release gives it."""
    return getattr(output, OUTPUT_CACHE_FIELD, None)
