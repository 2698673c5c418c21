//! Little-endian bit streams: value `i` of width `bits` starts at bit `start + i·bits`, bit 0
//! of a byte first. With 2 or 4 bits this is the familiar "index 0 in the low bits" packing.

/// Value of width `bits` (≤ 8) starting at bit `bit` of `src`.
#[inline(always)]
pub fn get(src: &[u8], bit: usize, bits: u32) -> u8 {
    let (byte, shift) = (bit / 8, bit % 8);
    let lo = u16::from(src[byte]);
    let hi = if shift + bits as usize > 8 {
        u16::from(src[byte + 1])
    } else {
        0
    };
    (((lo | hi << 8) >> shift) & ((1u16 << bits) - 1)) as u8
}

/// Writes the low `bits` bits (≤ 8) of `v` at bit `bit` of `out`, keeping the other bits.
#[inline(always)]
pub fn put(out: &mut [u8], bit: usize, bits: u32, v: u8) {
    let mask = (1u16 << bits) - 1;
    let (byte, shift) = (bit / 8, bit % 8);
    let w = (u16::from(v) & mask) << shift;
    let keep = !(mask << shift);
    out[byte] = (u16::from(out[byte]) & keep) as u8 | w as u8;
    if shift + bits as usize > 8 {
        out[byte + 1] = (out[byte + 1] & (keep >> 8) as u8) | (w >> 8) as u8;
    }
}

/// Writes the low `bits` bits of every value into `out` starting at bit `start`. Bits of
/// `out` outside the written range are preserved. `out` must be long enough (checked by the
/// callers' size arithmetic; debug builds assert it).
pub fn pack(values: &[u8], bits: u32, out: &mut [u8], start: usize) {
    if bits == 0 {
        return;
    }
    debug_assert!((start + values.len() * bits as usize).div_ceil(8) <= out.len());
    for (i, &v) in values.iter().enumerate() {
        put(out, start + i * bits as usize, bits, v);
    }
}

/// Reads `out.len()` values of width `bits` starting at bit `start` of `src`.
pub fn unpack(src: &[u8], bits: u32, start: usize, out: &mut [u8]) {
    if bits == 0 {
        out.fill(0);
        return;
    }
    debug_assert!((start + out.len() * bits as usize).div_ceil(8) <= src.len());
    for (i, o) in out.iter_mut().enumerate() {
        *o = get(src, start + i * bits as usize, bits);
    }
}

/// Bytes needed for `count` values of `bits` bits.
pub fn packed_len(count: usize, bits: u32) -> usize {
    (count * bits as usize).div_ceil(8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bit_positions_are_little_endian() {
        // 2-bit: values 1,2,3,0 → 0b00_11_10_01.
        let mut out = [0u8; 1];
        pack(&[1, 2, 3, 0], 2, &mut out, 0);
        assert_eq!(out[0], 0b0011_1001);
        // 3-bit values 5, 6, 7 → bits 101 | 110<<3 | 111<<6 = 0b1_1111_0101 (straddles).
        let mut out = [0u8; 2];
        pack(&[5, 6, 7], 3, &mut out, 0);
        assert_eq!(u16::from_le_bytes(out), 0b1_1111_0101);
        // 4-bit: low nibble first.
        let mut out = [0u8; 1];
        pack(&[0xA, 0x3], 4, &mut out, 0);
        assert_eq!(out[0], 0x3A);
    }

    #[test]
    fn round_trip_at_offsets_preserves_neighbours() {
        for bits in 1..=8u32 {
            let n = 37;
            let vals: Vec<u8> = (0..n)
                .map(|i| ((i * 7 + 3) % (1usize << bits)) as u8)
                .collect();
            let start = 5;
            let mut buf = vec![0xFFu8; packed_len(n, bits) + 2];
            pack(&vals, bits, &mut buf, start);
            let mut back = vec![0u8; n];
            unpack(&buf, bits, start, &mut back);
            assert_eq!(back, vals, "bits {bits}");
            // The 5 leading bits were 1s and must still be.
            assert_eq!(buf[0] & 0x1F, 0x1F, "bits {bits}");
        }
    }
}
