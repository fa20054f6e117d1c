//! [`P2pHeader`]: the 16 bytes an engine sends before a point-to-point
//! payload, so that a receive of the wrong size or type is an error instead
//! of a partial write or a hang (cpu-gloo, mpi, cuda-nccl, npu-hccl).

use crate::DType;

/// The last word of a header whose transport already matches tags
/// (cpu-gloo's slots, MPI's tags): "acc1", so that a stray message is
/// recognised.
pub const P2P_MAGIC: u32 = 0x6163_6331;

/// The header of one point-to-point message: the payload's byte count, its
/// element type's code ([`DType::code`]) and a last word, the message's tag
/// for transports that deliver in order without tags (NCCL, HCCL) or
/// [`P2P_MAGIC`]. Little-endian on the wire: `bytes` (8), `dtype` (4),
/// `tag` (4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pHeader {
    /// Payload bytes.
    pub bytes: u64,
    /// The payload's [`DType::code`] (a code this build may not know).
    pub dtype: u32,
    /// The tag, or [`P2P_MAGIC`].
    pub tag: u32,
}

impl P2pHeader {
    /// Bytes on the wire.
    pub const BYTES: usize = 16;

    /// The header of `count` elements of `dtype` with last word `tag`.
    pub fn new(dtype: DType, count: usize, tag: u32) -> P2pHeader {
        P2pHeader {
            bytes: (count * dtype.size()) as u64,
            dtype: dtype.code(),
            tag,
        }
    }

    /// The wire form.
    pub fn encode(&self) -> [u8; P2pHeader::BYTES] {
        let mut b = [0u8; P2pHeader::BYTES];
        b[..8].copy_from_slice(&self.bytes.to_le_bytes());
        b[8..12].copy_from_slice(&self.dtype.to_le_bytes());
        b[12..].copy_from_slice(&self.tag.to_le_bytes());
        b
    }

    /// Read the wire form (any 16 bytes decode; check what you expect).
    pub fn decode(b: &[u8; P2pHeader::BYTES]) -> P2pHeader {
        let mut w8 = [0u8; 8];
        w8.copy_from_slice(&b[..8]);
        let mut w4 = [0u8; 4];
        w4.copy_from_slice(&b[8..12]);
        let dtype = u32::from_le_bytes(w4);
        w4.copy_from_slice(&b[12..]);
        P2pHeader {
            bytes: u64::from_le_bytes(w8),
            dtype,
            tag: u32::from_le_bytes(w4),
        }
    }

    /// The payload's element type; `None` for a code this build does not
    /// know.
    pub fn element_type(&self) -> Option<DType> {
        DType::from_code(self.dtype)
    }

    /// The payload's byte count as a `usize`; `None` when it does not fit.
    pub fn byte_len(&self) -> Option<usize> {
        usize::try_from(self.bytes).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_in_the_wire_layout() {
        let h = P2pHeader::new(DType::F64, 3, 77);
        assert_eq!(h.bytes, 24);
        let wire = h.encode();
        assert_eq!(&wire[..8], &24u64.to_le_bytes());
        assert_eq!(&wire[8..12], &DType::F64.code().to_le_bytes());
        assert_eq!(&wire[12..], &77u32.to_le_bytes());
        assert_eq!(P2pHeader::decode(&wire), h);
        assert_eq!(h.element_type(), Some(DType::F64));
        assert_eq!(h.byte_len(), Some(24));
        assert_ne!(
            P2pHeader::new(DType::F32, 6, 77),
            h,
            "same bytes, other type"
        );
        let junk = P2pHeader::decode(&[0xff; 16]);
        assert_eq!(junk.element_type(), None);
        assert_ne!(junk.tag, P2P_MAGIC);
    }
}
