"""The one validated settings object of a controller process (environment EDGESPEC_*, then CLI flags)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from edgespec.model.kv_format import KVFormatName
from edgespec.workers.settings import comma_separated


def read_key_file(path: str) -> list[str]:
    """The keys in a file: one per line; blank lines and lines starting with # are skipped, spaces trimmed."""
    lines = (line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


class ServeSettings(BaseSettings):
    """Settings of `edgespec serve`."""

    model_config = SettingsConfigDict(env_prefix="EDGESPEC_", extra="forbid")

    model: str | None = Field(None, description="Hugging Face folder or .gguf file; default: embedded SmolLM2")
    served_model_name: str | None = Field(None, description="model id in the API; default: the model's name")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="require 'Authorization: Bearer KEY' on /v1 routes, KEY one of these "
        "(the flag repeated, or comma-separated; EDGESPEC_API_KEY comma-separated)")
    api_key_file: str | None = Field(None, description="more API keys, one per line (# comments, blank lines skipped)")
    policy: str = Field("speculative", description="default decoding policy: the fastest exact one measured "
                        "(README, 'Speed against llama.cpp')")
    dtype: Literal["auto", "q4_1", "q8_0", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weight format (`--weights`; see model/linear.py): auto keeps a GGUF's own "
        "quantization; q4_1 / q8_0 quantize at load; float32 / bfloat16 / float16 dequantize")
    kv_format: KVFormatName = Field(
        "float16", description="how the KV cache stores keys and values (model/kv_format.py; README, 'KV cache "
        "formats'): float16 (the default: half float32's bytes, measured as fast or faster, perplexity within "
        "noise), float32, or q8_0 (0.27 of float32's bytes)")
    threads: int = Field(0, ge=0, description="torch threads for the model; 0: all cores")
    kv_cache_gib: float = Field(2.0, gt=0, description="memory bound for all sessions' KV caches")
    kv_prefault: bool = Field(False, description="commit the KV pool's memory at load (its own and local "
                              "workers'): RSS then holds still while serving, and no other program can take it")
    max_request_bytes: int = Field(4 * 2**20, gt=0)
    max_header_bytes: int = Field(32 * 2**10, ge=1024, description="bound of a request's line and headers together "
                                  "(a longer head is refused with 431)")
    max_waiting: int = Field(64, ge=0, description="requests that may wait for KV cache room at once; more get 503")
    queue_timeout_s: float = Field(60.0, gt=0, description="how long a request may wait for KV cache room")
    local_workers: int = Field(0, ge=0, description="start N worker processes on loopback and serve through them")
    cluster: str | None = Field(None, description="TOML file naming running workers (see config/)")
    discover: bool = Field(False, description="find workers on the LAN by mDNS/DNS-SD (`edgespec worker` announces "
                           "itself) and adopt those that prove cluster_token; the explicit alternative: cluster")
    cluster_token: str | None = Field(None, min_length=1, description="the cluster's shared token, for --discover "
                                      "(EDGESPEC_CLUSTER_TOKEN; a cluster file carries its own)")
    discover_workers: int = Field(1, ge=0, description="with --discover: workers to wait for at start")
    discover_wait_s: float = Field(30.0, ge=0, description="with --discover: how long to wait for them at start; "
                                   "then serve with those found (none: every layer in-process until one is found)")
    stage_timeout_s: float = Field(60.0, gt=0, description="timeout of one call to a worker")
    recover_probe_s: float = Field(5.0, gt=0, description="after a failed call, a worker that does not answer "
                                   "within this is taken for lost and planned out (at most the stage timeout)")
    restart_wait_s: float = Field(180.0, ge=0, description="when no placement fits the workers left after a loss, "
                                  "how long work waits for a lost local worker to be started again and planned back "
                                  "in before it fails")
    worker_threads: int = Field(0, ge=0, description="torch threads of each local worker; 0: all cores")
    worker_memory_budget_gib: float | None = Field(None, gt=0, description="each local worker's bound for its "
                                                   "weights plus KV caches (default: the worker's own, 4 GiB); it "
                                                   "also bounds the controller's taking over every layer")
    worker_cpus: str | None = Field(None, description="CPU sets of the local workers, e.g. '0;1' (worker i gets "
                                                       "the i-th set); default: unpinned")
    placement: Literal["plan", "even"] = Field("plan", description="layers by the planner's DP, or evenly")
    profile: str | None = Field(None, description="profile JSON to plan from (default: the cached one, or measure)")
    reprofile: bool = Field(False, description="measure a new profile even when a cached one exists")
    profile_tag: str | None = Field(None, description="keeps cached profiles measured under other conditions apart")
    plan_context: int = Field(2048, ge=1, description="KV slots per session the placement must hold")
    plan_concurrency: int = Field(4, ge=1, description="sessions at once the placement must hold")
    memory_threshold: float = Field(0.85, gt=0, le=1, description="re-plan when a worker's memory use passes this")
    monitor_interval_s: float = Field(2.0, gt=0, description="how often the controller checks its workers")
    pipelined_prefill: bool = Field(True, description="cut long prompts into segments that flow through the "
                                                      "workers concurrently, where the plan says it pays")
    prefill_segment: int | None = Field(None, ge=1, description="fixed segment length for prefill (overrides the "
                                                                "plan's cuts; also in-process)")
    prefix_cache_mib: float = Field(256.0, ge=0, description="KV kept from finished requests for prefix reuse; 0: off")
    prefix_min_tokens: int = Field(32, ge=1, description="shortest shared prefix worth reusing")
    draft_models: list[str] = Field(default_factory=list, description="drafters for `speculative`: model folders "
                                    "or GGUF files sharing the served model's tokenizer, as PATH or NAME=PATH")
    layerskip: str | None = Field(None, description="offer the `layerskip` self-draft: the served model's layers "
                                                    "to keep, e.g. '0-11,28-29'")
    eagle: str = Field("auto", description="the trained feature drafter `eagle` (from `edgespec train-drafter`): "
                       "a file, 'auto' (the shipped one, when it was trained for the served model) or 'off'")
    medusa: str = Field("auto", description="Medusa heads for `medusa` (from `edgespec train-medusa`): a file, "
                        "'auto' (the shipped ones, when trained for the served model) or 'off'")
    draft_k: int = Field(4, ge=0, le=32, description="speculative draft length before any pass was timed; then "
                         "each step picks the length, within draft_k_min..draft_k_max, with the most expected "
                         "tokens per second (decoding/draft_cost.py; 0: a plain step; a request's `k` fixes it)")
    draft_k_min: int = Field(0, ge=0, le=32)
    draft_k_max: int = Field(16, ge=1, le=32)
    speculative_drafter: str | None = Field(None, description="the plain `speculative` policy's drafter")
    headsplit: bool = Field(True, description="offer the `headsplit` policy (its blocks load at its first request)")
    headsplit_epsilon: float = Field(0.05, ge=0, allow_inf_nan=False, description="`headsplit`'s default "
                                     "speculation tolerance "
                                     "||Z - X|| / ||X||; it also picks the profiled acceptance the placement uses")
    headsplit_profile: str | None = Field(None, description="HeadSplit profile JSON (default: the shipped one for "
                                          "the served model, from `edgespec profile-headsplit`)")
    tool_call_threshold: float = Field(-7.0, description="tool_choice auto: the answer is a call when log P(the "
                                       "call's opening | prompt) reaches this (SmolLM2-135M: device commands "
                                       "-4.6..-6.5, chit-chat -8.2..-16.4); higher calls less often")
    ollama_options: dict[str, Any] = Field(default_factory=dict, description="the Ollama API's options for "
                                           "requests that leave them unset, as a Modelfile's PARAMETER lines set "
                                           "them (Home Assistant's Ollama integration sends only num_ctx): JSON, "
                                           "e.g. '{\"temperature\": 0, \"num_predict\": 256}'")
    log_level: str = "info"

    @field_validator("api_key", mode="before")
    @classmethod
    def _split_keys(cls, v):
        return comma_separated(v)

    @field_validator("api_key_file")
    @classmethod
    def _key_file_readable(cls, v):
        if v is not None:  # a missing or unreadable file is an error at start, not a server without keys
            try:
                if not read_key_file(v):
                    raise ValueError(f"{v} holds no API key")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read the API key file: {exc}") from exc
        return v

    def api_keys(self) -> tuple[str, ...]:
        """Every accepted API key (flags, environment and --api-key-file); empty: /v1 routes are open."""
        from_file = read_key_file(self.api_key_file) if self.api_key_file else []
        return tuple(dict.fromkeys([*self.api_key, *from_file]))

    @model_validator(mode="after")
    def _one_way_to_workers(self) -> ServeSettings:
        if self.discover and (self.cluster or self.local_workers):
            raise ValueError("--discover finds the workers itself: not with --cluster or --local-workers")
        if self.discover and not self.cluster_token:
            raise ValueError("--discover needs the cluster's token: --cluster-token or EDGESPEC_CLUSTER_TOKEN")
        return self

    @model_validator(mode="after")
    def _draft_bounds(self) -> ServeSettings:
        if not self.draft_k_min <= self.draft_k <= self.draft_k_max:
            raise ValueError(f"need draft_k_min <= draft_k <= draft_k_max, got {self.draft_k_min}, {self.draft_k}, "
                             f"{self.draft_k_max}")
        return self
