"""Speculative decoding, one package behind one seam: the runner's host side asks `drafts.py` (which
requests' lengths the device alone knows, the drafts a schedule may carry, `1 + k` queries per
decode), and its programs run `sample.spec_sample_step` in place of the plain sampler: the drafts
verified by the rejection sampler (`rejection.py`), then the next ones proposed (`propose.py`: n-gram
lookup, `ngram.py`, or a draft model)."""
