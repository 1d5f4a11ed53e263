"""Speculative decoding: proposers (n-gram, the DSpark block drafter) and the rejection sampler."""
