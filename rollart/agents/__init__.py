"""Agent programs trained as they are: an OpenAI-compatible endpoint per episode on the env-host
(`openai_api`), each call one turn recorded token for token (`episode`), tool calls in the model's own
format (`tool_calls`)."""

from rollart.agents.episode import AgentCallError, AgentEpisode, EpisodeClosed, Reply
from rollart.agents.openai_api import AgentEndpoint, EpisodeAccess
from rollart.agents.tool_calls import MalformedToolCall, ToolCall, parse_tool_calls

__all__ = [
    "AgentCallError",
    "AgentEndpoint",
    "AgentEpisode",
    "EpisodeAccess",
    "EpisodeClosed",
    "MalformedToolCall",
    "Reply",
    "ToolCall",
    "parse_tool_calls",
]
