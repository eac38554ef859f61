"""Simulation: recorded rounds replayed under other costs, machines and policies."""
