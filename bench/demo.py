"""`make demo`: the end-to-end demo (verifier + edge client on localhost)."""

from __future__ import annotations

import sys


def main() -> int:
    print(
        "make demo will: start the cloud verifier with smollm2-135m (fp32) on localhost, run the edge "
        "client with the llama.cpp drafts (smollm2-135m-q4 and the weak smollm2-135m-q4-l8) on a few "
        "Spec-Bench prompts, stream the text, and print target-only vs sequence vs tree speculation "
        "(ms/token, tokens per round, target forwards per token).\n"
        "Not yet available: the verifier service and the edge client are being built."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
