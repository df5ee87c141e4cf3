// The RWKV World tokenizer's encoder: greedy longest match of UTF-8 bytes over the vocabulary's
// byte trie, ids written straight into a uint16 buffer (no Python int per token).
//
// Same ids as the reference TRIE_TOKENIZER of the `rwkv` package (tests/data/test_world.py): at
// each position take the longest vocabulary token that the remaining bytes start with. Every
// single byte is a token, so a match always exists.
//
// Layout, for the cache: the first byte's node comes from a 256-entry table and the first two
// bytes' from a 65,536-entry one (most tokens are 2-8 bytes: those two tables hold the hot
// part); deeper children from one open-addressed hash table keyed by (node, byte), at most half
// full (World: 116K nodes, 2 MB). Each node keeps its token id as uint16 (0: no token ends
// there; id 0 is the end of a document and has no bytes). Built once per process from the
// vocabulary (a few ms); read-only afterwards.

#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace {

struct Trie {
    std::vector<uint16_t> token;  // per node: the id of the token ending there, or 0
    std::vector<uint64_t> slots;  // hash table: (key + 1) << 32 | child, 0 = empty; key = node << 8 | byte
    uint64_t mask = 0;
    uint32_t first[256] = {};     // node of each one-byte prefix
    std::vector<uint32_t> second; // node of each two-byte prefix (first << 8 | second byte), 0: none

    static uint64_t hash(uint64_t key) { return (key * 0x9E3779B97F4A7C15ull) >> 24; }

    uint32_t child(uint32_t node, uint8_t byte) const {
        const uint64_t key = (uint64_t(node) << 8 | byte) + 1;
        for (uint64_t i = hash(key) & mask;; i = (i + 1) & mask) {
            const uint64_t s = slots[i];
            if (s == 0) return 0;
            if ((s >> 32) == key) return uint32_t(s);
        }
    }

    void put(uint64_t slot) {
        uint64_t i = hash(slot >> 32) & mask;
        while (slots[i] != 0) i = (i + 1) & mask;
        slots[i] = slot;
    }

    uint32_t add_child(uint32_t node, uint8_t byte) {
        const uint32_t created = uint32_t(token.size());
        token.push_back(0);
        put(((uint64_t(node) << 8 | byte) + 1) << 32 | created);
        return created;
    }

    // The table at `capacity` slots (a power of two above the entries): built roomy, then shrunk to
    // what the nodes need, so that the probes stay in few cache lines.
    void resize(uint64_t capacity) {
        std::vector<uint64_t> old(capacity, 0);
        old.swap(slots);
        mask = capacity - 1;
        for (uint64_t s : old)
            if (s != 0) put(s);
    }
};

}  // namespace

extern "C" {

// The trie of `n_ids` tokens: token t is bytes[offsets[t] .. offsets[t + 1]) (id 0 and unassigned
// ids are empty). NULL when the vocabulary is unusable: an id beyond 65,535, a byte with no
// one-byte token, or a token repeated under two ids.
void* rwkvx_world_new(const uint8_t* bytes, const int64_t* offsets, int64_t n_ids) {
    if (n_ids < 1 || n_ids > 65536) return nullptr;
    Trie* t = new (std::nothrow) Trie();
    if (t == nullptr) return nullptr;
    const int64_t total = offsets[n_ids] - offsets[0];
    uint64_t capacity = 1024;
    while (capacity < uint64_t(total) * 2) capacity <<= 1;  // every byte a node at most: load <= 0.5
    t->slots.assign(capacity, 0);
    t->mask = capacity - 1;
    t->token.reserve(size_t(total) + 1);
    t->token.push_back(0);  // the root
    for (int64_t id = 1; id < n_ids; id++) {
        if (offsets[id + 1] == offsets[id]) continue;
        uint32_t node = 0;
        for (int64_t k = offsets[id]; k < offsets[id + 1]; k++) {
            uint32_t next = t->child(node, bytes[k]);
            node = next != 0 ? next : t->add_child(node, bytes[k]);
        }
        if (t->token[node] != 0) {
            delete t;
            return nullptr;
        }
        t->token[node] = uint16_t(id);
    }
    uint64_t fit = 1024;
    while (fit < t->token.size() * 2) fit <<= 1;  // load factor <= 0.5
    t->resize(fit);
    t->second.assign(65536, 0);
    for (int a = 0; a < 256; a++) {
        t->first[a] = t->child(0, uint8_t(a));
        if (t->first[a] == 0 || t->token[t->first[a]] == 0) {
            delete t;
            return nullptr;
        }
        for (int b = 0; b < 256; b++) t->second[a << 8 | b] = t->child(t->first[a], uint8_t(b));
    }
    return t;
}

void rwkvx_world_free(void* trie) { delete static_cast<Trie*>(trie); }

// Encodes `n_texts` texts, text i being text[offsets[i] .. offsets[i + 1]), one after another into
// `out` (room for offsets[n_texts] - offsets[0] ids: a token is at least one byte); counts[i] gets
// text i's id count. Returns the total.
int64_t rwkvx_world_encode(const void* trie, const uint8_t* text, const int64_t* offsets, int64_t n_texts,
                           uint16_t* out, int64_t* counts) {
    const Trie& t = *static_cast<const Trie*>(trie);
    const uint16_t* token = t.token.data();
    int64_t written = 0;
    for (int64_t d = 0; d < n_texts; d++) {
        const uint8_t* s = text + offsets[d];
        const int64_t n = offsets[d + 1] - offsets[d];
        const int64_t start = written;
        int64_t i = 0;
        while (i < n) {
            uint32_t node = t.first[s[i]];
            uint16_t best = token[node];
            int64_t end = i + 1;
            if (i + 1 < n && (node = t.second[uint32_t(s[i]) << 8 | s[i + 1]]) != 0) {
                int64_t j = i + 2;
                if (token[node] != 0) best = token[node], end = j;
                while (j < n && (node = t.child(node, s[j])) != 0) {
                    j++;
                    if (token[node] != 0) best = token[node], end = j;
                }
            }
            out[written++] = best;
            i = end;
        }
        counts[d] = written - start;
    }
    return written;
}

}  // extern "C"
