"""Speculative decoding: drafts proposed on the device, verified by the rejection sampler."""
