"""transformers' own common model tests, taken from the sdist of the installed transformers version on PyPI.

The sdist ships ``tests/test_modeling_common.py``, ``tests/test_training_mixin.py`` and the parallelism mixins
(``test_tensor_parallel_mixin.py``, ``test_fsdp_mixin.py``, ``test_expert_parallel_mixin.py``) but not the modules
they import from ``tests/generation``, ``tests/exporters`` and ``tests/distributed_testing_utils.py``. The generation
and export mixins are replaced by empty classes: generation is covered by ``tests/test_generation.py`` instead, and
export by ``tests/test_compile.py``. The distributed helpers are this module's :class:`RankPool`: one CPU process per
rank, started once and reused by every distributed test of the session. Nothing of transformers' is stored in this
repository: the files are fetched with ``pip download`` on first use and cached outside the checkout.

``HF_MHC_TRANSFORMERS_TESTS`` overrides the cache folder (default ``~/.cache/hf-mhc``).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import queue
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers import LlamaConfig

from hf_mhc import MHCConfig, MHCForCausalLM, MHCForSequenceClassification, MHCModel

PACKAGE = "transformers_tests"
# Sub-modules that test_modeling_common imports but the sdist lacks, with the stand-in each gets.
STAND_INS = {
    "generation/test_utils.py": "class GenerationTesterMixin:\n"
    '    """Stand-in: mHC generation is tested in hf-mhc\'s tests/test_generation.py."""\n',
    "exporters/test_export.py": "class ExportTesterMixin:\n"
    '    """Stand-in: mHC models are traced with torch.compile in hf-mhc\'s tests/test_compile.py."""\n',
    "distributed_testing_utils.py": '"""Stand-in: the rank processes of hf-mhc\'s tests/transformers_suite.py."""\n'
    "from transformers_suite import (  # noqa: F401\n"
    "    _get_distributed_backend,\n    _get_distributed_device_type,\n    _get_rank_device,\n"
    "    _set_rank_device,\n    _start_rank_processes,\n    run_distributed,\n)\n",
}


def cache_root() -> Path:
    return Path(os.environ.get("HF_MHC_TRANSFORMERS_TESTS", Path.home() / ".cache" / "hf-mhc"))


def transformers_tests_root(version: str = transformers.__version__) -> Path:
    """A folder holding the package ``transformers_tests`` (the sdist's ``tests/*.py``) for ``version``."""
    root = cache_root() / f"transformers-{version}-tests"
    if (root / PACKAGE / "__init__.py").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as scratch:
        scratch = Path(scratch)
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"transformers=={version}", "--dest", str(scratch)],
            capture_output=True, text=True, timeout=600,
        )
        if download.returncode != 0:
            raise RuntimeError(f"could not fetch the transformers {version} sdist from PyPI: {download.stderr[-2000:]}")
        (archive,) = scratch.glob("transformers-*.tar.gz")
        package = scratch / "staged" / PACKAGE
        package.mkdir(parents=True)
        prefix = f"{archive.name.removesuffix('.tar.gz')}/tests/"
        with tarfile.open(archive) as sdist:
            for member in sdist.getmembers():
                name = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and member.isfile() and "/" not in name and name.endswith(".py"):
                    (package / name).write_bytes(sdist.extractfile(member).read())
        if not (package / "test_modeling_common.py").is_file():
            raise RuntimeError(f"the transformers {version} sdist has no tests/test_modeling_common.py")
        (package / "__init__.py").touch()
        write_stand_ins(package)
        try:
            (scratch / "staged").rename(root)
        except OSError:  # another process finished first: keep its copy
            if not (root / PACKAGE / "__init__.py").is_file():
                raise
        shutil.rmtree(scratch / "staged", ignore_errors=True)
    return root


def write_stand_ins(package: Path) -> None:
    """Write each of ``STAND_INS`` that is missing or differs (a cache from an older hf-mhc), atomically."""
    for relative, text in STAND_INS.items():
        path = package / relative
        if path.is_file() and path.read_text() == text:
            continue
        path.parent.mkdir(exist_ok=True)
        (path.parent / "__init__.py").touch()
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as staged:
            staged.write(text)
        os.replace(staged.name, path)


def import_transformers_tests():
    """Put the cached sdist tests on ``sys.path``; return ``(test_modeling_common, test_training_mixin)``."""
    add_transformers_tests_to_path()
    from transformers_tests import test_modeling_common, test_training_mixin

    return test_modeling_common, test_training_mixin


def import_parallel_mixins():
    """Put the cached sdist tests on ``sys.path``; return ``(test_tensor_parallel_mixin, test_fsdp_mixin,
    test_expert_parallel_mixin)``."""
    add_transformers_tests_to_path()
    from transformers_tests import test_expert_parallel_mixin, test_fsdp_mixin, test_tensor_parallel_mixin

    return test_tensor_parallel_mixin, test_fsdp_mixin, test_expert_parallel_mixin


def add_transformers_tests_to_path() -> None:
    root = transformers_tests_root()
    write_stand_ins(root / PACKAGE)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


# --- rank processes for the parallelism mixins ----------------------------------------------------------------------

# A job that a rank never finishes (a peer failed and left it waiting in a collective) fails after this long, and the
# process group of each job gives up on a collective after as long.
JOB_TIMEOUT_S = 300
# After one rank has failed, the others get this long to finish or fail too before the pool is stopped.
FAILURE_GRACE_S = 15


def _rank_loop(rank: int, jobs, results) -> None:
    """A rank process: run ``(function, args)`` jobs as ``function(rank, *args)`` until ``None`` arrives."""
    torch.set_num_threads(1)  # tiny models; 2 ranks share the machine
    while (job := jobs.get()) is not None:
        function, args = job
        try:
            function(rank, *args)
            results.put((rank, None))
        except BaseException:
            results.put((rank, traceback.format_exc()))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.use_deterministic_algorithms(False)  # the FSDP mixin switches it on for its run


class RankPool:
    """Rank processes (``spawn``), started once and reused: importing torch and transformers costs each new process
    seconds, more than most distributed tests run. Rank ``r`` is always process ``r``."""

    def __init__(self):
        self.context = multiprocessing.get_context("spawn")
        self.results = self.context.Queue()
        self.ranks: list[tuple[multiprocessing.Process, multiprocessing.Queue]] = []

    def run(self, function: Callable, args: tuple, nprocs: int, name: str | None = None) -> None:
        """``function(rank, *args)`` on ranks ``0 .. nprocs - 1``; raise with the traceback of the rank that failed
        first (the others may only have lost their peer). ``name`` names the job in that error."""
        while len(self.ranks) < nprocs:
            jobs = self.context.Queue()
            process = self.context.Process(target=_rank_loop, args=(len(self.ranks), jobs, self.results), daemon=True)
            process.start()
            self.ranks.append((process, jobs))
        for _, jobs in self.ranks[:nprocs]:
            jobs.put((function, args))
        failures, pending, deadline = {}, nprocs, time.monotonic() + JOB_TIMEOUT_S
        while pending:
            try:
                rank, error = self.results.get(timeout=1)
            except queue.Empty:
                dead = [rank for rank, (process, _) in enumerate(self.ranks[:nprocs]) if not process.is_alive()]
                if dead or time.monotonic() > deadline:
                    why = f"rank process(es) {dead} exited" if dead else "the job ran past its time"
                    failures.setdefault(dead[0] if dead else -1, f"{pending} rank(s) did not finish: {why}")
                    self.stop()
                    break
                continue
            pending -= 1
            if error is not None:
                failures[rank] = error
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if failures:
            rank, error = next(iter(failures.items()))
            raise RuntimeError(f"{name or function.__name__} failed on rank {rank}:\n{error}")

    def stop(self) -> None:
        """End the rank processes this pool started (a later ``run`` starts new ones)."""
        for process, jobs in self.ranks:
            if process.is_alive():
                jobs.put(None)
        for process, _ in self.ranks:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self.ranks = []
        self.results = self.context.Queue()  # nothing a stopped rank still sent reaches the next job


_POOL = RankPool()
atexit.register(_POOL.stop)


def _start_rank_processes(function: Callable, args: tuple = (), nprocs: int = 1, name: str | None = None) -> None:
    """``function(rank, *args)`` on ``nprocs`` ranks (it sets up its own process group)."""
    _POOL.run(function, tuple(args), nprocs, name)


def _with_process_group(rank: int, world_size: int, host: str, port: int, function: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=host,
                      MASTER_PORT=str(port))
    store = dist.TCPStore(host, port, world_size=None, is_master=False)
    dist.init_process_group(_get_distributed_backend(), store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=JOB_TIMEOUT_S))
    function(rank, *args)


def run_distributed(world_size: int) -> Callable:
    """``run_distributed(world_size)(function)(*args)``: ``function(rank, *args)`` on ``world_size`` ranks, each in a
    gloo process group of them all."""

    def decorate(function: Callable) -> Callable:
        def launch(*args) -> None:
            # The rendezvous store lives here, so that no other process can take its port while the ranks start.
            store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
            try:
                _start_rank_processes(_with_process_group, (world_size, store.host, store.port, function, args),
                                      nprocs=world_size, name=function.__name__)
            finally:
                del store

        return launch

    return decorate


def _get_distributed_backend() -> str:
    return "gloo"


def _get_distributed_device_type() -> str:
    return "cpu"


def _get_rank_device(rank: int) -> torch.device:
    return torch.device("cpu")


def _set_rank_device(rank: int) -> None:
    """CPU ranks need no device of their own."""


class MHCModelTester:
    """Tiny mHC models on a Llama backbone, with the attributes transformers' mixins read."""

    base_model_class = MHCModel
    causal_lm_class = MHCForCausalLM
    sequence_classification_class = MHCForSequenceClassification
    config_class = MHCConfig

    def __init__(self, parent, batch_size: int = 3, seq_length: int = 7, hc_mult: int = 3):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.hc_mult = hc_mult
        self.is_training = True
        self.vocab_size = 99
        self.hidden_size = 32
        self.num_hidden_layers = 2
        self.num_attention_heads = 4
        self.num_key_value_heads = 2
        self.intermediate_size = 37
        self.max_position_embeddings = 512
        self.num_labels = 3
        self.type_sequence_label_size = 2
        self.pad_token_id = 0
        self.bos_token_id = 1
        self.eos_token_id = 2

    @property
    def all_model_classes(self):
        return (self.base_model_class, self.causal_lm_class, self.sequence_classification_class)

    def backbone_kwargs(self) -> dict:
        """The tiny backbone's shape and special tokens, whatever its family."""
        return dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )

    def backbone_config(self):
        return LlamaConfig(**self.backbone_kwargs())

    def get_config(self) -> MHCConfig:
        # DeepSeek-V4's random initialisation: the maps are token-dependent, so the checks see real mixing.
        return MHCConfig(backbone_config=self.backbone_config(), hc_mult=self.hc_mult, hc_sinkhorn_iters=5,
                         hc_init="deepseek_v4", num_labels=self.num_labels, pad_token_id=self.pad_token_id)

    def prepare_config_and_inputs_for_common(self):
        input_ids = import_transformers_tests()[0].ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}
