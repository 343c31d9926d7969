curl -sS --fail-with-body {{ ingest_url_sh }} \
  -H "Authorization: Bearer $FLYWHEEL_API_KEY" \
  -H 'Content-Type: application/x-ndjson' \
  --data-binary @trajectories.jsonl
