"""Exactness proofs and agreement measures: the verification algorithms' output distributions."""
