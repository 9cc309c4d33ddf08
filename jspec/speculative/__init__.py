"""Speculative decoding: drafters propose, acceptance decides, the step ties them together."""

from jspec.speculative.acceptance import expected_accepted_length, greedy_accept, rejection_sample
from jspec.speculative.steps import SpecStep

__all__ = ["expected_accepted_length", "greedy_accept", "rejection_sample", "SpecStep"]
