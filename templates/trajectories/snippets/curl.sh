curl -sS --fail-with-body {{ ingest_url_sh }} \
  -H "Authorization: Bearer $FLYWHEEL_API_KEY" \
  -H 'Content-Type: application/json' \
  -d '{
    "external_id": "conversation-0001",
    "agent": "support",
    "model_version": "support-v1",
    "messages": [
      {"role": "user", "content": "Where is my order 1234?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_order", "arguments": "{\"order_id\": \"1234\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "{\"status\": \"shipped\"}"},
      {"role": "assistant", "content": "Your order 1234 has shipped."}
    ],
    "tools": [{"type": "function", "function": {"name": "get_order", "description": "Look up an order",
      "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}],
    "outcome": "success"
  }'
