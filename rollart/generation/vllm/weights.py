"""New weights for a running vLLM engine: checked against the checkpoint it loaded, then streamed to its worker.

vLLM runs the model in a worker process behind its engine-core process (on CPU too, with a single worker), and a
`collective_rpc`'s arguments take two hops to get there: msgpack from this process to the engine core, decoded
there without types, then pickle from the engine core to the worker. A torch tensor does not survive the first hop
(its bytes travel as a frame of their own, which the untyped decoder drops: it arrives as [dtype, shape, frame
index]) and a memoryview not the second (pickle refuses it). `bytes` survive both, but are copied four times on
the way, and at 64-256 MB took two to three times as long as a socket (docs/vllm.md). So only a ticket goes
through `collective_rpc`:
`WeightOffer` listens on a loopback port for the one connection that presents the ticket's token, and writes every
tensor's bytes to it from where they lie (no copy here for a contiguous CPU tensor, such as a view into a
`WeightReceiver` buffer); the worker (`rollart.generation.vllm.worker`) reads them into tensors of its own and reloads
the model in place. No file is involved: no staging folder, no shared-memory segment.

The check is `rollart.generation.checks.check_weights` against the names and shapes of the model folder's
checkpoint. With tied embeddings vLLM keeps its own lm_head unless `lm_head.weight` is loaded (on CPU the head is
packed apart from the embeddings), so the worker loads the embeddings' tensor under that name too; the bytes travel
once, whether or not the update carried `lm_head.weight`.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import socket
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import structlog

from rollart.errors import RollartError
from rollart.generation.checks import check_weights
from rollart.generation.vllm.worker import WeightTicket, byte_view

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("rollart.generation.vllm")

_TIED_NAME = "lm_head.weight"
_EMBED_NAME = "model.embed_tokens.weight"
_TOKEN_BYTES = 32


class VLLMWeightsFailed(RollartError):
    """vLLM's worker did not load a version; the message says whether its weights are unchanged."""


def checkpoint_shapes(model_path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the model folder's safetensors files (headers only); empty if there are none."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                shapes[name] = tuple(checkpoint.get_slice(name).get_shape())
    return shapes


def tied_aliases(tied: bool, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """{lm_head: embeddings} when the model ties them (config `tie_word_embeddings`) and has the embeddings."""
    return {_TIED_NAME: _EMBED_NAME} if tied and _EMBED_NAME in shapes else {}


def checked_tensors(
    version: int,
    weights: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    aliases: Mapping[str, str],
) -> list[tuple[str, torch.Tensor]]:
    """Check names and shapes against the checkpoint the engine loaded; the (name, tensor) pairs whose bytes go to
    the worker: every name but the aliases (loaded from their targets' bytes), each as contiguous CPU memory. A
    tensor that already is one (a view into a receive buffer, in any dtype) is sent as it is, without a copy."""
    check_weights(version, weights, shapes, aliases, equal=_equal)
    return [(name, _contiguous_cpu(tensor)) for name, tensor in weights.items() if name not in aliases]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return bool(torch.equal(a, b))


def _contiguous_cpu(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous()  # the tensor itself when it already is


class WeightOffer:
    """One version's tensors, offered on a loopback port to the one connection that presents `ticket`'s token.

    Use it as a context manager (it closes the port); `send()` serves the worker."""

    def __init__(
        self, tensors: list[tuple[str, torch.Tensor]], aliases: Mapping[str, str], *, timeout_s: float
    ) -> None:
        self._tensors = tensors
        token = secrets.token_bytes(_TOKEN_BYTES)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        host, port = self._listener.getsockname()[:2]
        self.ticket = WeightTicket(
            host=host,
            port=port,
            token=token,
            tensors=[(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors],
            aliases=dict(aliases),
            timeout_s=timeout_s,
        )
        """What the worker needs: pass `ticket.to_rpc()` to its load method."""
        self.refused = 0
        """Connections that did not present the token (closed, and the offer kept waiting)."""

    def __enter__(self) -> WeightOffer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._listener.close()

    async def send(self) -> None:
        """Accept until a connection presents the token, then write every tensor's bytes to it, in ticket order."""
        loop = asyncio.get_running_loop()
        while True:
            conn, peer = await loop.sock_accept(self._listener)
            with conn:
                try:
                    async with asyncio.timeout(self.ticket.timeout_s):
                        token = await _recv_exactly(loop, conn, _TOKEN_BYTES)
                except (TimeoutError, ConnectionError) as error:
                    token, reason = b"", repr(error)
                else:
                    reason = "wrong token"
                if not hmac.compare_digest(token, self.ticket.token):
                    self.refused += 1
                    log.warning("vllm weights: refused a connection to the weight port", peer=peer, reason=reason)
                    continue
                for _, tensor in self._tensors:
                    await loop.sock_sendall(conn, byte_view(tensor))
                return


async def _recv_exactly(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await loop.sock_recv(conn, n - len(data))
        if not chunk:
            raise ConnectionError("closed before sending the token")
        data += chunk
    return data
