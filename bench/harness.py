"""What the benches share, in one import: the prompt sets (shared/prompts.py) and the library in
bench/lib (its modules say what each holds): the common flags (`add_common_args`,
`add_model_args`), the result file (`write_result`: {"config", "rows", "complete"} and the bench's
own keys), a plot's saving (`save_figure`), a verifier in its own process pinned to its own cores
and the edge pinned to the others (docs/architecture.md §6), the verifier's counters."""

from __future__ import annotations

from bench.lib.args import add_common_args as add_common_args
from bench.lib.args import add_model_args as add_model_args
from bench.lib.args import add_prompt_file_arg as add_prompt_file_arg
from bench.lib.args import nonnegative_ints as nonnegative_ints
from bench.lib.args import positive_ints as positive_ints
from bench.lib.args import suite_from_args as suite_from_args
from bench.lib.procs import REPO as REPO
from bench.lib.procs import CoreSplit as CoreSplit
from bench.lib.procs import Proxy as Proxy
from bench.lib.procs import Verifier as Verifier
from bench.lib.procs import die_with_parent as die_with_parent
from bench.lib.procs import free_port as free_port
from bench.lib.procs import read_metrics as read_metrics
from bench.lib.procs import served as served
from bench.lib.results import RESULT_KEYS as RESULT_KEYS
from bench.lib.results import figure_rows as figure_rows
from bench.lib.results import read_runs as read_runs
from bench.lib.results import save_figure as save_figure
from bench.lib.results import table as table
from bench.lib.results import write_json as write_json
from bench.lib.results import write_result as write_result
from shared.prompts import DATA as DATA
from shared.prompts import HUMANEVAL as HUMANEVAL
from shared.prompts import PROMPTS as PROMPTS
from shared.prompts import BenchPrompt as BenchPrompt
from shared.prompts import load_humaneval as load_humaneval
from shared.prompts import load_prompt_file as load_prompt_file
from shared.prompts import load_prompts as load_prompts
from shared.prompts import load_suite as load_suite
