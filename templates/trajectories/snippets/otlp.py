import json
import os

{{ setup }}from openai import OpenAI
{{ import }}
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

# Once, when your agent starts: spans go to Flywheel, and the OpenAI client is traced.
provider = TracerProvider(resource=Resource.create({"service.name": "support"}))  # the trajectory's agent
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
    endpoint={{ otlp_url_py }},
    headers={"Authorization": f"Bearer {os.environ['FLYWHEEL_API_KEY']}"},
)))
trace.set_tracer_provider(provider)
OpenAIInstrumentor().instrument(tracer_provider=provider)
tracer = trace.get_tracer("support")

# Your agent, unchanged. One trace is one trajectory: open a span around each conversation.
client = OpenAI()
tools = [{"type": "function", "function": {
    "name": "get_order", "description": "Look up an order",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
}}]


def get_order(order_id):
    return {"order_id": order_id, "status": "shipped"}


messages = [{"role": "user", "content": "Where is my order 1234?"}]
with tracer.start_as_current_span("conversation"):
    while True:
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=tools)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = get_order(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})

provider.shutdown()  # before the process exits: sends the spans still buffered
