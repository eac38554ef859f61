"""The pages' tests drive Chromium with bench.end_to_end.browser (bench.end_to_end.js_edge uses it too)."""

from bench.end_to_end.browser import Browser, chromium

__all__ = ["Browser", "chromium"]
