//! Quarantine records in sled: `quarantine/v1` (id -> record), and a large body's chunks in
//! `quarantine_bodies/v1`, written before the record that notes their number (sled recovers a
//! prefix of its writes, so a record found has all its chunks).

use super::{
    body_len, corrupt, decode, decode_borrowed, encode, keys, QuarantineMeta, QuarantineMetaRaw,
    QuarantineRecord, SledStore, StoreError, StoredQuarantine, MAX_VALUE_BYTES,
};
use crate::port::Quarantine;

impl Quarantine for SledStore {
    /// Put a body in quarantine; returns its id.
    ///
    /// A body longer than [`MAX_VALUE_BYTES`] goes in chunks of that size
    /// (`quarantine_bodies/v1`), written before the record, which notes their number: sled
    /// recovers a prefix of its writes, so a record found has all its chunks.
    fn quarantine(&self, mut record: QuarantineRecord) -> Result<u64, StoreError> {
        record.id = self.db.generate_id()?;
        let mut stored = StoredQuarantine {
            body_chunks: None,
            body_bytes: None,
            record,
        };
        if stored.record.body_base64.len() > MAX_VALUE_BYTES {
            let text = std::mem::take(&mut stored.record.body_base64);
            let mut chunks = 0u32;
            for part in text.as_bytes().chunks(MAX_VALUE_BYTES) {
                self.quarantine_bodies
                    .insert(keys::quarantine_chunk(stored.record.id, chunks), part)?;
                chunks += 1;
            }
            stored.body_chunks = Some(chunks);
            stored.body_bytes = Some(body_len(&text, stored.record.body_gzip));
        }
        let id = stored.record.id;
        self.quarantine.insert(keys::seq(id), encode(&stored)?)?;
        Ok(id)
    }

    /// Every record, bodies included: for tests and small stores only; lists use
    /// [`SledStore::quarantine_page`].
    fn quarantined(&self) -> Result<Vec<QuarantineRecord>, StoreError> {
        self.quarantine
            .iter()
            .map(|item| self.quarantined_whole(&item?.1))
            .collect()
    }

    fn quarantined_one(&self, id: u64) -> Result<Option<QuarantineRecord>, StoreError> {
        self.quarantine
            .get(keys::seq(id))?
            .map(|bytes| self.quarantined_whole(&bytes))
            .transpose()
    }

    /// At most `limit` records after id `after` (from the first when `None`), in id order,
    /// without their bodies (a body is neither copied nor decoded), and the id to continue after
    /// when more remain.
    fn quarantine_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<(Vec<QuarantineMeta>, Option<u64>), StoreError> {
        let start = match after {
            None => 0,
            Some(u64::MAX) => return Ok((Vec::new(), None)),
            Some(id) => id + 1,
        };
        let mut page = Vec::new();
        for item in self.quarantine.range(keys::seq(start)..) {
            let (_, value) = item?;
            if page.len() == limit {
                let next = page.last().map(|m: &QuarantineMeta| m.id);
                return Ok((page, next));
            }
            let raw: QuarantineMetaRaw<'_> = decode_borrowed(&value, "quarantine record")?;
            page.push(raw.into_meta());
        }
        Ok((page, None))
    }

    /// Remove a quarantine record (after it was re-processed, or past its retention), then its
    /// body's chunks: a crash between leaves chunks without a record, which an open removes
    /// ([`SledStore::drop_orphan_quarantine_bodies`]), never a record without its body.
    fn release_quarantined(&self, id: u64) -> Result<bool, StoreError> {
        let removed = self.quarantine.remove(keys::seq(id))?.is_some();
        for key in self.quarantine_bodies.scan_prefix(keys::seq(id)).keys() {
            self.quarantine_bodies.remove(key?)?;
        }
        Ok(removed)
    }
}

impl SledStore {
    /// A stored record with its body (read back from its chunks when it has them).
    pub(super) fn quarantined_whole(&self, bytes: &[u8]) -> Result<QuarantineRecord, StoreError> {
        let stored: StoredQuarantine = decode(bytes, "quarantine record")?;
        let mut record = stored.record;
        if let Some(chunks) = stored.body_chunks {
            let mut text = Vec::new();
            for i in 0..chunks {
                let part = self
                    .quarantine_bodies
                    .get(keys::quarantine_chunk(record.id, i))?
                    .ok_or_else(|| corrupt("quarantine body: a chunk is missing"))?;
                text.extend_from_slice(&part);
            }
            record.body_base64 =
                String::from_utf8(text).map_err(|_| corrupt("quarantine body: not base64"))?;
        }
        Ok(record)
    }

    /// On open: remove body chunks whose record is gone (a crash after the record's removal, or
    /// before it was written: a delivery never acknowledged). Nothing quarantines meanwhile.
    pub(super) fn drop_orphan_quarantine_bodies(&self) -> Result<(), StoreError> {
        let mut dropped = 0;
        let mut checked: Option<(Vec<u8>, bool)> = None;
        for key in self.quarantine_bodies.iter().keys() {
            let key = key?;
            let id = key.get(..8).unwrap_or(&key).to_vec();
            let kept = match &checked {
                Some((seen, kept)) if *seen == id => *kept,
                _ => {
                    let kept = self.quarantine.contains_key(&id)?;
                    checked = Some((id, kept));
                    kept
                }
            };
            if !kept {
                self.quarantine_bodies.remove(key)?;
                dropped += 1;
            }
        }
        if dropped > 0 {
            tracing::info!(
                chunks = dropped,
                "removed quarantine body chunks without a record"
            );
        }
        Ok(())
    }
}
