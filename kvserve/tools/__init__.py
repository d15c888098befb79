"""Tool calling, independent of any one HTTP API.

`plan_tools` turns a model's chat template, the request's tools and its tool choice into a
`ToolPlan`: what the prompt gains (tools for the template, or a system prompt in the generic
mode), the grammar that enforces the call syntax, and a streaming parser that splits generated
text into content and calls. `template_messages` renders a conversation that carries earlier calls
and their results the way the template expects.
"""

from kvserve.tools.formats import ToolFormat, detect_format
from kvserve.tools.history import ChatTurn, HistoryCall, template_messages
from kvserve.tools.parser import ArgumentsDelta, CallStarted, ContentDelta, ToolCallParser, ToolEvent
from kvserve.tools.plan import ToolPlan, plan_tools
from kvserve.tools.spec import FunctionTool, Mode, ToolCall, ToolChoice, ToolError

__all__ = [
    "ArgumentsDelta", "CallStarted", "ChatTurn", "ContentDelta", "FunctionTool", "HistoryCall", "Mode",
    "ToolCall", "ToolCallParser", "ToolChoice", "ToolError", "ToolEvent", "ToolFormat", "ToolPlan",
    "detect_format", "plan_tools", "template_messages",
]
