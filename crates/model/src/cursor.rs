//! [`Cursor`]: where an event is in a store's log, opaque above the store.

/// A position in the store's log of events: where an event is stored, where the log ended, the
/// folds' low watermark. Ordered as the log is (a later event has a greater cursor), copied
/// freely, and encoded in 16 bytes that sort as the cursors do. What it holds is the backend's
/// own (the sled backend's event-log segment and offset, a table backend's sequence number):
/// everything above the store only compares, keeps and hands cursors back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cursor(u128);

impl Cursor {
    /// The start of every log (at or before every event).
    pub const START: Cursor = Cursor(0);
    /// The length of [`Cursor::encode`].
    pub const LEN: usize = 16;

    /// A backend's position as a cursor (for backends only: the value means nothing to others).
    pub const fn from_raw(raw: u128) -> Cursor {
        Cursor(raw)
    }

    /// The backend's position back (for the backend that made the cursor).
    pub const fn raw(self) -> u128 {
        self.0
    }

    /// Big-endian, so encoded cursors sort as cursors do.
    pub const fn encode(self) -> [u8; Self::LEN] {
        self.0.to_be_bytes()
    }

    /// A cursor from its encoding (the first [`Cursor::LEN`] bytes); `None` when too short.
    pub fn decode(bytes: &[u8]) -> Option<Cursor> {
        let raw: [u8; Self::LEN] = bytes.get(..Self::LEN)?.try_into().ok()?;
        Some(Cursor(u128::from_be_bytes(raw)))
    }
}

#[cfg(test)]
mod tests {
    use super::Cursor;

    #[test]
    fn encoded_cursors_sort_as_cursors_and_read_back() {
        let cursors = [0, 1, 255, 256, 1 << 64, (1 << 64) + 7, u128::MAX].map(Cursor::from_raw);
        for pair in cursors.windows(2) {
            assert!(pair[0] < pair[1]);
            assert!(pair[0].encode() < pair[1].encode());
        }
        for c in cursors {
            assert_eq!(Cursor::decode(&c.encode()), Some(c));
        }
        assert_eq!(Cursor::decode(&[1; 15]), None);
        assert_eq!(Cursor::default(), Cursor::START);
    }
}
