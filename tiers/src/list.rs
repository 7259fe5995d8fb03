//! The slab-backed doubly linked list that every recency or FIFO order of the crate uses.
//!
//! A [`Slab`] stores values in the slots of one `Vec`, reusing freed slots before it grows;
//! any number of [`List`]s thread through its slots by index, each slot on at most one
//! list at a time. Linking, unlinking and moving a slot are O(1), and there is no pointer
//! and no `unsafe`: a "pointer" is a slot index, and [`NIL`] ends a list.
//!
//! The two ends are named for eviction: the *front* holds the most recently inserted or
//! used slot, the *back* the next one to evict. A `List` is a plain value beside its slab
//! (its ends and length), so a structure may keep several lists over one slab and pass
//! each to the slab's methods without borrowing the others.
//!
//! What the slab does not check: that a slot given to [`Slab::unlink`] is on the list
//! given with it, and that a freed slot is not used again. Callers know which list holds a
//! slot (the ledger records its queue in the value); debug builds assert what they can.

/// A slot index meaning "none": the end of a list, or an unlinked slot's neighbour.
pub const NIL: usize = usize::MAX;

#[derive(Clone, Debug)]
struct Node<T> {
    value: T,
    /// Towards the front (more recently inserted or used), or NIL.
    newer: usize,
    /// Towards the back (next to evict), or NIL.
    older: usize,
}

/// Values in reusable slots, linked into [`List`]s by index.
#[derive(Clone, Debug)]
pub struct Slab<T> {
    nodes: Vec<Node<T>>,
    /// Freed slots of `nodes`, reused (last freed first) before `nodes` grows.
    vacant: Vec<usize>,
}

/// One list through a [`Slab`]: its two ends and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct List {
    /// Most recently linked slot, or NIL when empty.
    front: usize,
    /// Next slot to evict, or NIL when empty.
    back: usize,
    len: usize,
}

impl List {
    /// An empty list.
    pub const fn new() -> Self {
        List {
            front: NIL,
            back: NIL,
            len: 0,
        }
    }

    /// The most recently linked slot.
    pub fn front(&self) -> Option<usize> {
        (self.front != NIL).then_some(self.front)
    }

    /// The slot at the back: the next to evict.
    pub fn back(&self) -> Option<usize> {
        (self.back != NIL).then_some(self.back)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Default for List {
    fn default() -> Self {
        List::new()
    }
}

impl<T> Slab<T> {
    pub fn new() -> Self {
        Slab {
            nodes: Vec::new(),
            vacant: Vec::new(),
        }
    }

    /// Stores `value` in a free slot (a freed one if any) and returns it, on no list.
    pub fn alloc(&mut self, value: T) -> usize {
        let node = Node {
            value,
            newer: NIL,
            older: NIL,
        };
        match self.vacant.pop() {
            Some(slot) => {
                self.nodes[slot] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// Frees `slot`, which must be on no list, for a later [`Slab::alloc`]. Its value stays
    /// until the slot is reused.
    pub fn free(&mut self, slot: usize) {
        debug_assert!(self.nodes[slot].newer == NIL && self.nodes[slot].older == NIL);
        self.vacant.push(slot);
    }

    pub fn get(&self, slot: usize) -> &T {
        &self.nodes[slot].value
    }

    pub fn get_mut(&mut self, slot: usize) -> &mut T {
        &mut self.nodes[slot].value
    }

    /// Links `slot`, which must be on no list, at the front of `list`.
    pub fn push_front(&mut self, list: &mut List, slot: usize) {
        let node = &mut self.nodes[slot];
        debug_assert!(node.newer == NIL && node.older == NIL && list.front != slot);
        node.older = list.front;
        node.newer = NIL;
        if list.front == NIL {
            list.back = slot;
        } else {
            self.nodes[list.front].newer = slot;
        }
        list.front = slot;
        list.len += 1;
    }

    /// Takes `slot` off `list`, which must hold it; it is then on no list.
    pub fn unlink(&mut self, list: &mut List, slot: usize) {
        let Node { newer, older, .. } = self.nodes[slot];
        if newer == NIL {
            debug_assert_eq!(list.front, slot);
            list.front = older;
        } else {
            self.nodes[newer].older = older;
        }
        if older == NIL {
            debug_assert_eq!(list.back, slot);
            list.back = newer;
        } else {
            self.nodes[older].newer = newer;
        }
        list.len -= 1;
        self.nodes[slot].newer = NIL;
        self.nodes[slot].older = NIL;
    }

    /// Moves `slot` from wherever it is on `list` to its front.
    pub fn move_to_front(&mut self, list: &mut List, slot: usize) {
        self.unlink(list, slot);
        self.push_front(list, slot);
    }

    /// The slots of `list` and their values, from the back (next to evict) to the front.
    pub fn iter_back_to_front<'a>(
        &'a self,
        list: &List,
    ) -> impl Iterator<Item = (usize, &'a T)> + 'a {
        let mut slot = list.back;
        std::iter::from_fn(move || {
            if slot == NIL {
                return None;
            }
            let node = &self.nodes[slot];
            let item = (slot, &node.value);
            slot = node.newer;
            Some(item)
        })
    }
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    /// What a script does to two lists over one slab: the values are small integers, at
    /// most one slot per value.
    #[derive(Clone, Copy, Debug)]
    enum Op {
        /// Allocate `v` and link it at the front of list `l` (if `v` is not held).
        Push(u8, usize),
        /// Move `v` to the front of its list.
        Touch(u8),
        /// Unlink and free `v`.
        Remove(u8),
        /// Unlink `v` and link it at the front of the other list.
        Switch(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..16, 0usize..2).prop_map(|(v, l)| Op::Push(v, l)),
            (0u8..16).prop_map(Op::Touch),
            (0u8..16).prop_map(Op::Remove),
            (0u8..16).prop_map(Op::Switch),
        ]
    }

    proptest! {
        /// Two lists over one slab read back exactly as two deques (front first) would.
        #[test]
        fn lists_behave_as_deques(ops in proptest::collection::vec(op(), 0..200)) {
            let mut slab = Slab::new();
            let mut lists = [List::new(); 2];
            let mut model: [VecDeque<u8>; 2] = Default::default();
            // Value to (slot, list).
            let mut held: [Option<(usize, usize)>; 16] = [None; 16];
            for op in ops {
                match op {
                    Op::Push(v, l) if held[v as usize].is_none() => {
                        let slot = slab.alloc(v);
                        slab.push_front(&mut lists[l], slot);
                        model[l].push_front(v);
                        held[v as usize] = Some((slot, l));
                    }
                    Op::Touch(v) => if let Some((slot, l)) = held[v as usize] {
                        slab.move_to_front(&mut lists[l], slot);
                        model[l].retain(|&x| x != v);
                        model[l].push_front(v);
                    },
                    Op::Remove(v) => if let Some((slot, l)) = held[v as usize].take() {
                        slab.unlink(&mut lists[l], slot);
                        slab.free(slot);
                        model[l].retain(|&x| x != v);
                    },
                    Op::Switch(v) => if let Some((slot, l)) = held[v as usize] {
                        slab.unlink(&mut lists[l], slot);
                        slab.push_front(&mut lists[1 - l], slot);
                        model[l].retain(|&x| x != v);
                        model[1 - l].push_front(v);
                        held[v as usize] = Some((slot, 1 - l));
                    },
                    Op::Push(..) => {}
                }
                for l in 0..2 {
                    let got: Vec<u8> = slab.iter_back_to_front(&lists[l]).map(|(_, &v)| v).collect();
                    let want: Vec<u8> = model[l].iter().rev().copied().collect();
                    prop_assert_eq!(&got, &want);
                    prop_assert_eq!(lists[l].len(), want.len());
                    prop_assert_eq!(lists[l].front().map(|s| *slab.get(s)), model[l].front().copied());
                    prop_assert_eq!(lists[l].back().map(|s| *slab.get(s)), model[l].back().copied());
                }
            }
            // Freed slots are reused: the slab never holds more slots than values ever held at once.
            prop_assert!(slab.nodes.len() <= 16);
        }
    }
}
