"""Test and benchmark support (never imported by production modules): a fake OpenAI engine, a
redis-server started on a loopback port."""
