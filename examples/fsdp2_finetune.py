"""Fine-tune an mHC causal LM with FSDP2 (hf_mhc.distributed.apply_fsdp2) for a few AdamW steps, then save it.

    torchrun --nproc_per_node=2 examples/fsdp2_finetune.py --steps 20 --output-dir outputs/fsdp2
    torchrun --nproc_per_node=8 examples/fsdp2_finetune.py --model MHC_FOLDER --bf16 --output-dir outputs/fsdp2

Every rank holds a shard of every parameter and trains on its own rows of each global batch (--batch-size rows per
rank). Backend: NCCL on GPUs (one per rank), gloo on CPU. With --bf16 the decoder layers compute in bfloat16 and
reduce gradients in float32, while the hyper-connection maps stay float32 units of their own.

--model: an mHC folder (``hf-mhc convert`` makes one). Default: ../shared/assets/stories260K (a real pretrained
Llama) upcycled to 4 streams when that folder exists, else a tiny random Llama with a byte-level tokenizer, upcycled.
--dataset: local .txt files (a path or a glob), one training text per paragraph (empty ones are skipped). Default:
Jane Austen's novels from ../shared/assets/janeausten when present, else Python's own help texts (pydoc_data).

Output (--output-dir, which must be empty or new unless --overwrite): rank 0 gathers the full state dict and writes
an ordinary mHC folder (config, safetensors, tokenizer, the mHC remote-code files) that
``AutoModelForCausalLM.from_pretrained`` loads, with ``import hf_mhc`` or with ``trust_remote_code=True``.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # example_utils, also when this file is imported by path

import example_utils  # noqa: E402
from example_utils import JANEAUSTEN, STORIES260K, add_example_option  # noqa: E402

import hf_mhc  # noqa: E402


def parse_args(
    description: str,
    argv: list[str] | None,
    batch_help: str,
    extra_options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The options both torchrun examples take (``extra_options`` adds more), checked: one line for each mistake."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if extra_options is not None:
        extra_options(parser)
    parser.add_argument("--model", help="an mHC folder (default: see above)")
    parser.add_argument("--dataset", help="local .txt files, a path or a glob (default: see above)")
    add_example_option(parser, "--steps", default=20)
    parser.add_argument("--batch-size", type=int, default=4, help=batch_help)
    add_example_option(parser, "--block-size", default=64)
    parser.add_argument("--lr", type=example_utils.learning_rate, default=5e-4,
                        help="AdamW learning rate (default 5e-4)")
    add_example_option(parser, "--seed")
    parser.add_argument("--output-dir", required=True, help="where rank 0 saves the trained mHC folder")
    parser.add_argument("--overwrite", action="store_true", help="save into a non-empty --output-dir")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 compute for the backbone, float32 HC maps")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        parser.error(f"--output-dir {output_dir} is a file")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not args.overwrite:
        parser.error(f"--output-dir {output_dir} is not empty: pass --overwrite to save into it")
    if args.model is not None:
        if not Path(args.model).is_dir():
            parser.error(f"--model {args.model}: no such folder")
        model_type = example_utils.load_config(parser, args.model).model_type
        if model_type != "mhc":
            parser.error(f"--model {args.model} is a {model_type!r} model, not mHC: convert it with "
                         "`hf-mhc convert SRC OUT` first")
    if args.dataset is not None and not glob.glob(os.path.expanduser(args.dataset)):
        parser.error(f"--dataset {args.dataset}: no such file")
    return parser, args


def start_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun process group: ``(rank, world_size, device)``, NCCL on a GPU per rank, else gloo on CPU."""
    if "RANK" not in os.environ:
        sys.exit(f"run this under torchrun, e.g. torchrun --nproc_per_node=2 {sys.argv[0]} --output-dir OUT")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def byte_tokenizer():
    """A byte-level tokenizer without merges: one token per UTF-8 byte (256) and ``<|endoftext|>`` (256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={char: index for index, char in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def tiny_model(seed: int) -> tuple[hf_mhc.MHCForCausalLM, object]:
    """A 2-layer random Llama (hidden 64, tied embeddings) over :func:`byte_tokenizer`, upcycled to 4 streams; the
    same on every rank for the same ``seed``."""
    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(seed)
    return hf_mhc.upcycle(LlamaForCausalLM(config)), tokenizer


def load_model(args: argparse.Namespace) -> tuple[hf_mhc.MHCForCausalLM, object, str]:
    """``(model, tokenizer, description)``: ``--model``, else stories260K upcycled, else :func:`tiny_model`. Float32
    weights, identical on every rank."""
    if args.model is not None:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError, TypeError) as exc:
            sys.exit(f"--model {args.model} has no tokenizer ({str(exc).strip().splitlines()[0]})")
        return model, tokenizer, args.model
    if STORIES260K.is_dir():
        source = AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=torch.float32)
        return hf_mhc.upcycle(source), AutoTokenizer.from_pretrained(STORIES260K), "stories260K, upcycled"
    model, tokenizer = tiny_model(args.seed)
    return model, tokenizer, "a tiny random Llama with a byte-level tokenizer, upcycled"


def paragraphs(spec: str | None) -> Iterator[str]:
    """Non-empty paragraphs of the ``--dataset`` files, else of Jane Austen's novels, else of pydoc_data."""
    if spec is None and not JANEAUSTEN.is_dir():
        return example_utils.pydoc_paragraphs()
    files = sorted(glob.glob(os.path.expanduser(spec))) if spec else sorted(JANEAUSTEN.glob("*.txt"))
    return example_utils.paragraphs(Path(file).read_text(encoding="utf-8", errors="replace") for file in files)


def training_blocks(tokenizer, spec: str | None, count: int, block_size: int) -> torch.Tensor:
    """The first ``count`` blocks ``[count, block_size]`` (int64) of the dataset's paragraphs
    (:func:`example_utils.token_blocks`); only as much text is read as they need."""
    blocks = example_utils.token_blocks(paragraphs(spec), tokenizer, block_size, max_blocks=count)
    if len(blocks) < count:
        sys.exit(f"the dataset gives only {len(blocks)} blocks of {block_size} tokens; {count} are needed "
                 "(lower --steps, --batch-size or --block-size)")
    return torch.tensor(blocks)


def check_block_size(model: hf_mhc.MHCForCausalLM, block_size: int) -> None:
    positions = model.config.backbone_config.max_position_embeddings
    if block_size > positions:
        sys.exit(f"--block-size {block_size} exceeds the model's {positions} positions")


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hf_mhc.distributed import apply_fsdp2

    _, args = parse_args(__doc__, argv, "sequences per rank per step (default 4)")
    rank, world_size, device = start_distributed()
    model, tokenizer, description = load_model(args)
    check_block_size(model, args.block_size)
    global_batch = args.batch_size * world_size
    blocks = training_blocks(tokenizer, args.dataset, args.steps * global_batch, args.block_size)
    if rank == 0:
        print(f"model: {description}; {world_size} ranks, {global_batch} sequences of {args.block_size} per step")

    model.to(device).train()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    apply_fsdp2(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after sharding: it steps the shards
    for step in range(args.steps):
        batch = blocks[step * global_batch : (step + 1) * global_batch]
        local = batch[rank * args.batch_size : (rank + 1) * args.batch_size].to(device)
        loss = model(local, labels=local).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().float()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        if not math.isfinite(mean_loss.item()):
            sys.exit(f"step {step + 1}: the loss is {mean_loss.item()}; lower --lr")
        if rank == 0:
            print(f"step {step + 1}/{args.steps}: loss {mean_loss.item():.4f}", flush=True)

    # Every rank takes part in the gather; rank 0 receives the full tensors on CPU and writes the folder.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        model.save_pretrained(args.output_dir, state_dict=state)
        tokenizer.save_pretrained(args.output_dir)
        print(f"saved {args.output_dir}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
