//! TFRecord framing: `u64 length | u32 masked CRC32C(length) | data | u32 masked CRC32C(data)`,
//! all little-endian, so a reader can check every record and stop cleanly at a torn tail.

use std::io::{self, Write};

/// CRC32C rotated and offset as TFRecord stores it.
pub fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Write one record.
pub fn write_record(w: &mut dyn Write, data: &[u8]) -> io::Result<()> {
    let len = (data.len() as u64).to_le_bytes();
    w.write_all(&len)?;
    w.write_all(&masked_crc(&len).to_le_bytes())?;
    w.write_all(data)?;
    w.write_all(&masked_crc(data).to_le_bytes())
}

/// Read the records of a TFRecord byte string, stopping at the first torn or corrupt one.
pub fn read_records(mut bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while bytes.len() >= 12 {
        let (len_bytes, rest) = bytes.split_at(8);
        let len_crc = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
        if masked_crc(len_bytes) != len_crc {
            break;
        }
        let mut lb = [0u8; 8];
        lb.copy_from_slice(len_bytes);
        let Ok(len) = usize::try_from(u64::from_le_bytes(lb)) else {
            break;
        };
        let rest = &rest[4..];
        if rest.len() < len.saturating_add(4) {
            break;
        }
        let (data, rest) = rest.split_at(len);
        let crc = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
        if masked_crc(data) != crc {
            break;
        }
        out.push(data.to_vec());
        bytes = &rest[4..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_vectors() {
        // RFC 3720 B.4: 32 bytes of zeros, of 0xff, and "123456789" (the check value)
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c::crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn masking_rotates_and_offsets() {
        // crc 0xe3069283 rotated right by 15 bits, plus 0xa282ead8 (mod 2^32)
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
    }

    #[test]
    fn records_round_trip_and_a_torn_tail_is_dropped() {
        let mut buf = Vec::new();
        write_record(&mut buf, b"first").unwrap();
        write_record(&mut buf, b"").unwrap();
        write_record(&mut buf, b"third record").unwrap();
        assert_eq!(buf.len(), 3 * 16 + 5 + 12);
        let recs = read_records(&buf);
        assert_eq!(
            recs,
            vec![b"first".to_vec(), vec![], b"third record".to_vec()]
        );
        let torn = &buf[..buf.len() - 3];
        assert_eq!(read_records(torn).len(), 2);
        let mut corrupt = buf.clone();
        corrupt[16 + 5 + 14] ^= 1;
        assert_eq!(read_records(&corrupt).len(), 1);
    }
}
