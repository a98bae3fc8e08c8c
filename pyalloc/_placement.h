// SimDevice's index of live segments for placing new ones in O(log n) (_sim.pyx).
//
// Each live segment is a node keyed by its start address and holding the gap below it: the
// bytes from its predecessor's end, rounded up to the device's alignment, to its own start (0
// when there is no room; SIZE_MAX for the lowest segment, which has no predecessor). The nodes
// form a treap whose every node also holds the largest gap in its subtree, so the lowest (or the
// highest) segment above (below) an address whose gap fits a request is found in one descent:
// first-fit and top-down placement without walking every live segment.
//
// The index only answers queries; SimDevice keeps it in step with its map of segments (the
// gaps of a new or freed segment's successor change with it).
#pragma once
#include <cstddef>
#include <cstdint>

namespace pyalloc {

class GapIndex {
public:
    GapIndex() = default;
    GapIndex(const GapIndex&) = delete;
    GapIndex& operator=(const GapIndex&) = delete;
    ~GapIndex() { destroy(root_); }

    void insert(uintptr_t start, size_t gap) {
        Node* n = new Node{start, gap, gap, mix(start), nullptr, nullptr};
        Node *lo, *hi;
        split(root_, start, lo, hi);
        root_ = merge(merge(lo, n), hi);
    }

    void erase(uintptr_t start) {
        Node *lo, *mid, *hi;
        split(root_, start, lo, hi);         // lo: below start
        split_after(hi, start, mid, hi);     // mid: the node at start (if any)
        destroy(mid);
        root_ = merge(lo, hi);
    }

    void set_gap(uintptr_t start, size_t gap) { set_gap(root_, start, gap); }

    // The lowest segment starting above `after` whose gap is at least n.
    bool lowest_fit_above(uintptr_t after, size_t n, uintptr_t* start, size_t* gap) const {
        const Node* t = lowest_fit_above(root_, after, n);
        if (t == nullptr) return false;
        *start = t->start;
        *gap = t->gap;
        return true;
    }

    // The highest segment starting below `before` whose gap is at least n.
    bool highest_fit_below(uintptr_t before, size_t n, uintptr_t* start, size_t* gap) const {
        const Node* t = highest_fit_below(root_, before, n);
        if (t == nullptr) return false;
        *start = t->start;
        *gap = t->gap;
        return true;
    }

private:
    struct Node {
        uintptr_t start;
        size_t gap;
        size_t max_gap;       // largest gap in this subtree
        uint64_t priority;    // heap order (a hash of start: deterministic, well spread)
        Node* left;
        Node* right;
    };
    Node* root_ = nullptr;

    static uint64_t mix(uint64_t x) {           // splitmix64's finaliser
        x += 0x9E3779B97F4A7C15ull;
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
        x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
        return x ^ (x >> 31);
    }
    static size_t max_gap(const Node* t) { return t ? t->max_gap : 0; }
    static void pull(Node* t) {
        size_t m = t->gap;
        if (max_gap(t->left) > m) m = max_gap(t->left);
        if (max_gap(t->right) > m) m = max_gap(t->right);
        t->max_gap = m;
    }
    static void destroy(Node* t) {
        if (t == nullptr) return;
        destroy(t->left);
        destroy(t->right);
        delete t;
    }
    // lo: nodes starting below key; hi: the rest.
    static void split(Node* t, uintptr_t key, Node*& lo, Node*& hi) {
        if (t == nullptr) { lo = hi = nullptr; return; }
        if (t->start < key) {
            split(t->right, key, t->right, hi);
            lo = t;
        } else {
            split(t->left, key, lo, t->left);
            hi = t;
        }
        pull(t);
    }
    // lo: nodes starting at or below key; hi: the rest.
    static void split_after(Node* t, uintptr_t key, Node*& lo, Node*& hi) {
        if (t == nullptr) { lo = hi = nullptr; return; }
        if (t->start <= key) {
            split_after(t->right, key, t->right, hi);
            lo = t;
        } else {
            split_after(t->left, key, lo, t->left);
            hi = t;
        }
        pull(t);
    }
    static Node* merge(Node* a, Node* b) {       // every start in a is below every start in b
        if (a == nullptr) return b;
        if (b == nullptr) return a;
        if (a->priority > b->priority) {
            a->right = merge(a->right, b);
            pull(a);
            return a;
        }
        b->left = merge(a, b->left);
        pull(b);
        return b;
    }
    static void set_gap(Node* t, uintptr_t key, size_t gap) {
        if (t == nullptr) return;
        if (key < t->start) set_gap(t->left, key, gap);
        else if (key > t->start) set_gap(t->right, key, gap);
        else t->gap = gap;
        pull(t);
    }
    static const Node* lowest_fit_above(const Node* t, uintptr_t after, size_t n) {
        if (t == nullptr || t->max_gap < n) return nullptr;
        if (t->start <= after) return lowest_fit_above(t->right, after, n);
        const Node* found = lowest_fit_above(t->left, after, n);
        if (found != nullptr) return found;
        if (t->gap >= n) return t;
        return lowest_fit_above(t->right, after, n);
    }
    static const Node* highest_fit_below(const Node* t, uintptr_t before, size_t n) {
        if (t == nullptr || t->max_gap < n) return nullptr;
        if (t->start >= before) return highest_fit_below(t->left, before, n);
        const Node* found = highest_fit_below(t->right, before, n);
        if (found != nullptr) return found;
        if (t->gap >= n) return t;
        return highest_fit_below(t->left, before, n);
    }
};

}  // namespace pyalloc
