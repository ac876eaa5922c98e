"""tests/ mirrors the package: every public module ``mapmatched_torch/<part>/<module>.py``
has ``tests/<part>/test_<module>.py``, or an entry in :data:`TESTED_ELSEWHERE` naming the
test files that test it and saying why they live there.

Modules whose name starts with an underscore are private helpers, tested through the
public module that uses them; the root modules (``cli.py``, ``testing.py``) are not in
a part.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mapmatched_torch"

#: module (relative to mapmatched_torch/) -> the test files that test it. Each is tested
#: through the public code that uses it, or beside the module it belongs with.
TESTED_ELSEWHERE = {
    # core/: plain-Python helpers, tested through every entry point that uses them
    "core/checks.py": ("tests/retrieval/test_session.py", "tests/core/test_models.py"),  # the argument errors
    "core/embeddings.py": ("tests/standalone/test_knn.py", "tests/graph/test_knn.py"),  # the kNN input checks
    "core/graph_types.py": ("tests/standalone/test_graph.py", "tests/graph/test_cache.py"),  # GraphEdge, CacheInfo
    "core/optional.py": ("tests/providers_fixtures.py",),  # the missing-extra errors of every adapter
    # the per-turn helpers, through the sessions and the server that share them
    "retrieval/turns.py": ("tests/retrieval/test_session.py", "tests/serving/test_server.py"),
    # the server's halves: saving and loading (round trips, crafted and bit-flipped states,
    # migration), session IDs and the lock, through the server's tests
    "serving/persistence.py": ("tests/serving/test_server.py", "tests/serving/test_saved_state.py"),
    "serving/session_ids.py": ("tests/serving/test_server.py",),
    "serving/locking.py": ("tests/serving/test_server.py",),
    # the command line, through the commands it runs
    "cli/parser.py": ("tests/eval/test_cli.py",),
    "cli/run.py": ("tests/eval/test_cli.py", "tests/eval/test_model_fit.py"),
    "cli/serve.py": ("tests/integrations/test_ray_serve.py", "tests/eval/test_graph_command.py"),
    "core/path_reports.py": ("tests/retrieval/test_torch_decoder.py",),  # reports == the standalone decoder's
    "core/trace_build.py": ("tests/core/test_trace.py",),  # build_trace and classify_move, with the trace
    "core/protocols.py": ("tests/standalone/test_graph.py", "tests/providers/test_faiss.py"),  # isinstance checks
    # shard(): its blocks and errors, and the sharded eval and fit equal to one process
    "core/sharding.py": ("tests/eval/test_distributed.py", "tests/fit/test_distributed_fit.py"),
    # reading a model directory: through the writer's tests and from_pretrained's
    "core/model_artifacts.py": ("tests/fit/test_artifacts.py", "tests/retrieval/test_pretrained.py"),
    # kernels/: the argument checks and the streaming states of the functional API, tested
    # with it; the fused decoders' numba kernels and the runtime that calls every numba
    # kernel, through the fused decoders
    "kernels/checks.py": ("tests/kernels/test_decode.py",),
    "kernels/states.py": ("tests/kernels/test_decode.py",),
    "kernels/fused_cpu_kernels.py": ("tests/kernels/test_fused.py",),
    "kernels/fused_step_kernels.py": ("tests/kernels/test_fused_step.py",),
    # the slot table's save and load: round trips, crafted states and bit flips, with the table
    "kernels/slot_persistence.py": ("tests/kernels/test_slot_decoder.py", "tests/serving/test_server.py"),
    "kernels/normalization_kernels.py": ("tests/kernels/test_normalization.py",),  # both paths, bit for bit
    "kernels/numba_runtime.py": ("tests/kernels/test_fused.py", "tests/graph/test_shortest_paths.py"),
    # the import mode and device checks of every Triton kernel, through the kernels
    "kernels/triton_runtime.py": ("tests/kernels/test_triton_kernels.py", "tests/kernels/test_backend.py"),
    # the online dynamic programs the eval methods rank by, tested with them (against
    # sessions and enumeration) and against the fused kernels that compute them too
    "kernels/online.py": ("tests/eval/test_methods.py", "tests/kernels/test_fused.py"),
    # graph/engines/: every engine is tested against the others and the standalone graph
    # graph/convert.py: the conversions behind TensorCorpusGraph.from_*/to_*, tested through
    # those methods (the file predates the split of tensor_graph.py)
    "graph/convert.py": ("tests/graph/test_tensor_graph.py",),
    # the context table: built, carried by artifacts and refused there, with them
    "graph/neighborhood_table.py": ("tests/graph/test_artifacts.py",),
    "graph/engines/base.py": ("tests/graph/test_shortest_paths.py",),
    "graph/engines/hybrid.py": ("tests/graph/test_shortest_paths.py",),
    "graph/engines/compiled.py": ("tests/graph/test_shortest_paths.py",),
    "graph/engines/compiled_kernels.py": ("tests/graph/test_shortest_paths.py",),
    "graph/engines/frontier.py": ("tests/graph/test_shortest_paths.py",),
    "graph/engines/scipy_dijkstra.py": ("tests/graph/test_shortest_paths.py",),
    # providers/: the shared base is tested through every provider; fusion beside dense
    "providers/base.py": ("tests/providers_fixtures.py", "tests/providers/test_dense.py"),
    "providers/fusion.py": ("tests/providers/test_dense.py",),
    # serving/: chunk codes and context tables, tested with the store's tensor step
    "serving/codes.py": ("tests/serving/test_session_store.py", "tests/serving/test_bounded_state.py"),
    # fit/: the synthetic sampler is checked with the path sampler it draws from
    "fit/sampling.py": ("tests/kernels/test_sampling.py", "tests/fit/test_fitting.py"),
    # fit/threads.py: its doctest, and the byte-for-byte torchrun report it exists for
    "fit/threads.py": ("tests/test_doctests.py", "tests/eval/test_distributed.py"),
    # fit/: the packing, the loss and the validation metric, split out of fitting.py: tested
    # with fit_weights in its tests (the files predate the split)
    "fit/packing.py": ("tests/fit/test_fitting.py", "tests/fit/test_streamed_fit.py"),
    "fit/loss.py": ("tests/fit/test_fitting.py",),
    "fit/metric.py": ("tests/fit/test_fitting.py",),
    # eval/: the harness's inputs and plots, tested with the methods and the report
    "eval/candidates.py": ("tests/eval/test_methods.py",),
    "eval/distances.py": ("tests/eval/test_methods.py",),
    "eval/plots.py": ("tests/eval/test_report.py",),
    # the harness's config, inputs and summary, split out of runner.py: tested through
    # evaluate() in the harness's tests (the files predate the split)
    "eval/config.py": ("tests/eval/test_runner.py",),
    "eval/inputs.py": ("tests/eval/test_runner.py", "tests/eval/test_data.py"),
    "eval/summary.py": ("tests/eval/test_runner.py", "tests/eval/test_report.py"),
    # eval/datasets/: one loader per format, split out of data.py: tested in the data
    # tests (the file predates the split)
    "eval/datasets/normalized.py": ("tests/eval/test_data.py",),
    "eval/datasets/inscit.py": ("tests/eval/test_data.py",),
    "eval/datasets/topiocqa.py": ("tests/eval/test_data.py",),
    "eval/datasets/trec_cast.py": ("tests/eval/test_data.py",),
    # eval/methods/: one module per family of methods, tested per method through the
    # registry and the harness (the files predate the split of methods.py)
    "eval/methods/registry.py": ("tests/eval/test_methods.py",),
    "eval/methods/map_matched.py": ("tests/eval/test_methods.py", "tests/eval/test_runner.py"),
    "eval/methods/baselines.py": ("tests/eval/test_methods.py",),
    "eval/methods/fitted.py": ("tests/eval/test_runner.py", "tests/eval/test_selection.py"),
    "eval/methods/gated.py": ("tests/eval/test_gated_method.py",),
    "eval/methods/mixed.py": ("tests/eval/test_mixed_method.py",),
}


def public_modules():
    """Every public module of a part, as its path relative to mapmatched_torch/."""
    return sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.parent != PACKAGE and not path.name.startswith("_")
    )


def mirror(module: str) -> Path:
    """tests/<part>/test_<module>.py for ``<part>/<module>.py``."""
    path = Path(module)
    return ROOT / "tests" / path.parent / f"test_{path.name}"


def test_every_public_module_has_its_test_file_or_says_where_it_is_tested():
    missing = [module for module in public_modules() if not mirror(module).is_file() and module not in TESTED_ELSEWHERE]
    assert missing == [], "add tests/<part>/test_<module>.py (or a TESTED_ELSEWHERE entry, with the reason)"


def test_the_allow_list_names_real_modules_without_a_test_file_and_existing_tests():
    modules = set(public_modules())
    assert sorted(set(TESTED_ELSEWHERE) - modules) == []  # a module that moved or went away
    stale = sorted(module for module in TESTED_ELSEWHERE if mirror(module).is_file())
    assert stale == [], "these have their own test file now: drop them from TESTED_ELSEWHERE"
    for module, tests in TESTED_ELSEWHERE.items():
        assert tests and all((ROOT / test).is_file() for test in tests), module


def test_the_mirror_of_a_module():
    assert mirror("kernels/chain.py") == ROOT / "tests" / "kernels" / "test_chain.py"
    assert mirror("graph/engines/frontier.py") == ROOT / "tests" / "graph" / "engines" / "test_frontier.py"
    assert "kernels/chain.py" in public_modules() and "cli.py" not in public_modules()
    assert not any(Path(module).name.startswith("_") for module in public_modules())
