"""An OpenAI- and Anthropic-compatible gateway over any token-level ``AsyncServer``, with
per-session recording of the exact tokens, so black-box agents (the ``openai`` and
``anthropic`` clients, LangChain's ``ChatOpenAI``, agent SDKs) can be trained on what the engine
generated. Chat completions, the Responses API (:func:`create_response`) and the Messages API
(:func:`create_message`, :func:`count_tokens`) share one renderer and one recording.

``Gateway`` and ``SessionRecorder`` need nothing beyond core; ``create_gateway_app``,
``GatewayThread`` and ``serve_gateway`` need the ``[server]`` extra
(``pip install "agentloop-engines[server]"``), imported when they are called.
"""

from agentloop_engines.serving.gateway.app import (
    SESSION_HEADER,
    SESSION_KEY_HEADER,
    GatewayThread,
    add_gateway_routes,
    create_gateway_app,
    serve_gateway,
    session_base_path,
)
from agentloop_engines.serving.gateway.core import Gateway
from agentloop_engines.serving.gateway.images import GatewayImages
from agentloop_engines.serving.gateway.live import stream_chat_completion, stream_completion
from agentloop_engines.serving.gateway.messages_api import count_tokens, create_message
from agentloop_engines.serving.gateway.openai_response import GatewayResponse
from agentloop_engines.serving.gateway.prompt_limits import PromptLimitError, PromptLimits
from agentloop_engines.serving.gateway.recorder import (
    RecordedCall,
    SessionBudgetError,
    SessionCallLimitError,
    SessionExistsError,
    SessionNotFoundError,
    SessionRecorder,
    check_session_id,
)
from agentloop_engines.serving.gateway.responses_api import create_response
from agentloop_engines.serving.gateway.stop import StopMatch, find_stop

__all__ = [
    "SESSION_HEADER",
    "SESSION_KEY_HEADER",
    "Gateway",
    "GatewayImages",
    "GatewayResponse",
    "GatewayThread",
    "PromptLimitError",
    "PromptLimits",
    "RecordedCall",
    "SessionBudgetError",
    "SessionCallLimitError",
    "SessionExistsError",
    "SessionNotFoundError",
    "SessionRecorder",
    "StopMatch",
    "add_gateway_routes",
    "check_session_id",
    "count_tokens",
    "create_gateway_app",
    "create_message",
    "create_response",
    "find_stop",
    "serve_gateway",
    "session_base_path",
    "stream_chat_completion",
    "stream_completion",
]
