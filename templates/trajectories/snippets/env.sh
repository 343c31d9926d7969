export FLYWHEEL_URL={{ base_url_sh }}
export FLYWHEEL_API_KEY={{ key_sh }}
