"""Prompts prefilled once and reused: the library's prompt cache.

- ``files``: one prefilled row in one checked (optionally signed) file,
  continued in a later process exactly as the prefill left it;
- ``memory``: finished conversations' caches in a radix trie per scope,
  found again by the longest prefix a new prompt shares, least recently
  used evicted past a budget;
- ``disk``: that cache's entries kept as files in one directory, indexed
  by their headers, signed with the directory's own key;
- ``scoring``: many prompts scored with each shared beginning prefilled once.

Scopes keep whoever uses the cache apart: every entry is stored in one, and
a lookup walks only its own (the server's: one per API key and
``cache_salt``, ``serve.access.tenant_scope``); nothing stored in one scope
is found, or tells of itself, from another.
"""
