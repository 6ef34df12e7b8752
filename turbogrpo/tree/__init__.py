"""Tree-shared training forward: a group's sequences as a trie, every shared token encoded once."""

from turbogrpo.tree.trie import TokenTrie, build_trie, trie_of_groups

__all__ = ["TokenTrie", "build_trie", "trie_of_groups"]
